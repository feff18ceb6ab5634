// The engine's API key, for the page at / and for /docs: kept in sessionStorage (this tab, until it closes) and
// sent as "Authorization: Bearer KEY". When a call answers 401, ask() shows a small form for the key.
"use strict";

const DisaggKey = (() => {
  const NAME = "disagg-api-key";
  let asking = null; // one form at a time, however many calls answered 401

  function get() {
    try {
      return sessionStorage.getItem(NAME) || "";
    } catch (e) {
      return "";
    }
  }

  function set(key) {
    try {
      sessionStorage.setItem(NAME, key);
    } catch (e) {
      /* storage off: the key lasts as long as the page */
    }
  }

  function headers(extra) {
    const out = Object.assign({}, extra || {});
    const key = get();
    if (key) out.Authorization = "Bearer " + key;
    return out;
  }

  // A form (label, password field, button) at the top of `parent`; resolves with the key once one is given.
  function ask(parent, message) {
    if (asking) return asking;
    asking = new Promise((resolve) => {
      const form = document.createElement("form");
      form.className = "key-form";
      form.id = "key-form";
      const label = document.createElement("label");
      label.htmlFor = "api-key";
      label.textContent = "API key";
      const input = document.createElement("input");
      input.id = "api-key";
      input.type = "password";
      input.autocomplete = "off";
      input.required = true;
      const button = document.createElement("button");
      button.type = "submit";
      button.textContent = "Use key";
      const note = document.createElement("p");
      note.className = "key-message";
      note.textContent = message || "This engine needs an API key.";
      form.append(note, label, input, button);
      form.addEventListener("submit", (event) => {
        event.preventDefault();
        const key = input.value.trim();
        if (!key) return;
        set(key);
        form.remove();
        asking = null;
        resolve(key);
      });
      parent.prepend(form);
      input.focus();
    });
    return asking;
  }

  return { get, set, headers, ask };
})();
