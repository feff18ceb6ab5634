// /docs: Swagger UI sends the API key the page stored (key.js) with every request, /openapi.json's included.
// Loaded after swagger-ui-bundle.js and before the script that creates the UI (router/api/web.py).
"use strict";

(() => {
  const original = window.SwaggerUIBundle;

  function withKey(options) {
    return original(Object.assign({}, options, {
      requestInterceptor(request) {
        const key = DisaggKey.get();
        const named = Object.keys(request.headers || {}).some((h) => h.toLowerCase() === "authorization");
        if (key && !named) request.headers = Object.assign({}, request.headers, { Authorization: "Bearer " + key });
        return request;
      },
      responseInterceptor(response) {
        // The spec itself needs the key: ask for it, then load the page again with it.
        if (response.status === 401 && new URL(response.url, location.href).pathname === options.url) {
          const message = DisaggKey.get() ? "That API key was refused; enter the engine's key."
                                          : "This engine needs an API key to show its API.";
          DisaggKey.ask(document.body, message).then(() => location.reload());
        }
        return response;
      },
    }));
  }

  window.SwaggerUIBundle = Object.assign(withKey, original);
})();
