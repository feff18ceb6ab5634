// The page at /: a form over the OpenAI-style endpoints. Video models: a job (POST /v1/videos), polled for its
// progress, then its MP4. Image models: POST /v1/images/generations (with uploaded images: /v1/images/edits,
// the images as data: URLs) with an X-Request-Id whose progress GET /progress/{id} tells. Text from the engine or its users is only ever set as textContent.
"use strict";

const $ = (id) => document.getElementById(id);
const POLL_MS = 250; // between polls, unless the engine's openai-poll-after-ms says otherwise
const FIELDS = ["width", "height", "num_frames", "num_inference_steps"];
let model = null; // GET /v1/models' entry
let shownURL = null; // the blob: URL of what the result shows

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// fetch with the stored API key; a 401 asks for the key and tries again with it.
async function api(path, options = {}) {
  for (;;) {
    const res = await fetch(path, Object.assign({}, options, { headers: DisaggKey.headers(options.headers) }));
    if (res.status !== 401) return res;
    const message = DisaggKey.get() ? "That API key was refused; enter the engine's key."
                                    : "This engine needs an API key.";
    await DisaggKey.ask($("main"), message);
  }
}

// The engine's message of a failed answer ({"error": {"message"}}), else its status.
async function failure(res) {
  let message = `${res.status} ${res.statusText}`;
  try {
    const body = await res.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (e) {
    /* not JSON */
  }
  return new Error(message);
}

async function json(path, options) {
  const res = await api(path, options);
  if (!res.ok) throw await failure(res);
  return res.json();
}

async function blobOf(path) {
  const res = await api(path);
  if (!res.ok) throw await failure(res);
  return res.blob();
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

// null: indeterminate (no step known yet).
function setProgress(value, text) {
  const bar = $("progress");
  bar.hidden = false;
  if (value === null || value === undefined) bar.removeAttribute("value");
  else bar.value = value;
  $("status").textContent = text || "";
}

// --- the model and its defaults ------------------------------------------------------------------------------
async function loadModel() {
  model = (await json("/v1/models")).data[0];
  const defaults = model.defaults || {};
  $("model").textContent = `${model.id} (${model.video ? "video" : "image"}, ${model.pipeline})`;
  // Image models that take images: the size is the model's for the image unless one is typed.
  const image = model.image_input || "none";
  const sizeFromImage = (!model.video && image !== "none") || model.sized_by_image;
  for (const name of FIELDS) {
    if (sizeFromImage && (name === "width" || name === "height")) $(name).placeholder = "auto";
    else if (defaults[name] !== undefined && defaults[name] !== null) $(name).value = defaults[name];
  }
  // The guidance input is the field that scales the model's classifier-free guidance (e.g. true_cfg_scale).
  const guidance = defaults[guidanceField()];
  if (guidance !== undefined && guidance !== null) $("guidance_scale").value = guidance;
  $("frames-field").hidden = !model.video;
  // Video models: the first frame (a video job's input_reference); image models: the image(s) to edit.
  const most = model.max_images ?? (image === "none" ? 0 : 1);
  $("image-field").hidden = image === "none";
  $("image").required = image === "required";
  $("image").multiple = most > 1;
  $("image-field").querySelector("label").textContent =
    most > 1 ? `Input images (up to ${most}, ${image})` : `Input image (${image})`;
  $("submit").disabled = false;
}

// --- the request -------------------------------------------------------------------------------------------------
function guidanceField() {
  return model.guidance_field || "guidance_scale";
}

function number(id) {
  const text = $(id).value.trim();
  if (text === "") return undefined;
  const value = Number(text);
  return Number.isFinite(value) ? value : text; // the engine names a bad value
}

function readDataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(new Error(`could not read ${file.name}`));
    reader.readAsDataURL(file);
  });
}

// The body both endpoints take: OpenAI's fields plus the engine's extra ones; a field left empty is left out
// (the model's default).
async function requestBody() {
  const defaults = model.defaults || {};
  const body = { prompt: $("prompt").value };
  const negative = $("negative_prompt").value;
  if (negative.trim()) body.negative_prompt = negative;
  const files = $("image-field").hidden ? [] : Array.from($("image").files);
  const width = number("width");
  const height = number("height");
  // An edit with no size typed: the model's size for its image(s); a model sized by its image alone: none.
  const untyped = width === undefined && height === undefined;
  if (untyped && model.sized_by_image) { /* the image's aspect bucket */ }
  else if (untyped && files.length && !model.video) body.size = "auto";
  else body.size = `${width ?? defaults.width}x${height ?? defaults.height}`;
  const extra = { num_inference_steps: number("num_inference_steps"), seed: number("seed"),
                  [guidanceField()]: number("guidance_scale") };
  if (model.video) extra.num_frames = number("num_frames");
  for (const [name, value] of Object.entries(extra)) {
    if (value !== undefined) body[name] = value;
  }
  if (model.video && files.length) {
    body.input_reference = { image_url: await readDataURL(files[0]) };
  } else if (files.length) { // an edit: the engine checks how many the model takes
    const urls = await Promise.all(files.map(readDataURL));
    body.image = urls.length === 1 ? urls[0] : urls;
  }
  return body;
}

function pollAfter(res) {
  const ms = Number(res.headers.get("openai-poll-after-ms"));
  return Number.isFinite(ms) && ms > 0 ? ms : POLL_MS;
}

async function generateVideo(body) {
  let job = await json("/v1/videos", { method: "POST", headers: { "Content-Type": "application/json" },
                                       body: JSON.stringify(body) });
  refreshRecent();
  while (job.status !== "completed" && job.status !== "failed") {
    setProgress(job.progress, `${job.status.replace("_", " ")} ${job.progress}%`);
    const res = await api(`/v1/videos/${encodeURIComponent(job.id)}`);
    if (!res.ok) throw await failure(res);
    job = await res.json();
    if (job.status !== "completed" && job.status !== "failed") await sleep(pollAfter(res));
  }
  refreshRecent();
  if (job.status === "failed") throw new Error((job.error && job.error.message) || "the job failed");
  setProgress(100, "completed");
  await showVideo(job);
}

function randomId() {
  const bytes = crypto.getRandomValues(new Uint8Array(12));
  return "web-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

// GET /progress/{id} until stopped; an engine without it (or a request not yet in flight) leaves the bar as it is.
function followProgress(requestId) {
  let stopped = false;
  (async () => {
    while (!stopped) {
      await sleep(POLL_MS);
      if (stopped) break;
      try {
        const res = await api(`/progress/${encodeURIComponent(requestId)}`);
        if (!res.ok || stopped) continue;
        const p = await res.json();
        const step = p.steps ? `, step ${p.step}/${p.steps}` : "";
        if (!stopped) setProgress(p.progress, `${p.stage}${step} ${p.progress}%`);
      } catch (e) {
        /* keep the indeterminate bar */
      }
    }
  })();
  return () => { stopped = true; };
}

async function generateImage(body) {
  const requestId = randomId();
  setProgress(null, "generating");
  const stop = followProgress(requestId);
  let res;
  try {
    res = await api(body.image === undefined ? "/v1/images/generations" : "/v1/images/edits", {
      method: "POST", headers: { "Content-Type": "application/json", "X-Request-Id": requestId },
      body: JSON.stringify(body) });
  } finally {
    stop();
  }
  if (!res.ok) throw await failure(res);
  const out = await res.json();
  const bytes = Uint8Array.from(atob(out.data[0].b64_json), (c) => c.charCodeAt(0));
  setProgress(100, "completed");
  show("image", new Blob([bytes], { type: "image/png" }), "image.png", body.prompt);
  refreshRecent();
}

async function generate(event) {
  event.preventDefault();
  showError("");
  $("submit").disabled = true;
  try {
    const body = await requestBody();
    await (model.video ? generateVideo(body) : generateImage(body));
  } catch (e) {
    showError(e.message);
    $("progress").hidden = true;
    $("status").textContent = "";
  } finally {
    $("submit").disabled = false;
  }
}

// --- results -------------------------------------------------------------------------------------------------
function show(kind, blob, filename, prompt, contentPath) {
  if (shownURL) URL.revokeObjectURL(shownURL);
  shownURL = URL.createObjectURL(blob); // media needs the key too: fetched with it, shown from memory
  const video = $("video");
  const picture = $("picture");
  video.hidden = kind !== "video";
  picture.hidden = kind !== "image";
  if (kind === "video") {
    video.muted = false; // a model with sound: its MP4's audio track plays
    video.src = shownURL;
    picture.removeAttribute("src");
  } else {
    picture.src = shownURL;
    video.removeAttribute("src");
    video.load();
  }
  const link = $("download");
  link.href = shownURL;
  link.download = filename;
  link.textContent = `Download ${filename}`;
  if (contentPath) link.dataset.content = contentPath;
  else delete link.dataset.content;
  $("result-prompt").textContent = prompt;
  $("result").hidden = false;
}

async function showVideo(job) {
  const path = `/v1/videos/${encodeURIComponent(job.id)}/content`;
  show("video", await blobOf(path), `${job.id}.mp4`, job.prompt, path);
}

async function openItem(item) {
  showError("");
  try {
    if (!model.video) {
      const path = `/v1/images/${encodeURIComponent(item.id)}/content`;
      show("image", await blobOf(path), `${item.id}.png`, item.prompt, path);
      return;
    }
    const job = await json(`/v1/videos/${encodeURIComponent(item.id)}`);
    if (job.status === "completed") await showVideo(job);
    else if (job.status === "failed") showError((job.error && job.error.message) || "the job failed");
    else showError(`${job.id} is ${job.status.replace("_", " ")} (${job.progress}%)`);
  } catch (e) {
    showError(e.message);
  }
}

// --- recent generations --------------------------------------------------------------------------------------
function recentItem(item) {
  const li = document.createElement("li");
  const button = document.createElement("button");
  button.type = "button";
  button.className = "job";
  button.dataset.id = item.id;
  const prompt = document.createElement("span");
  prompt.className = "prompt";
  prompt.textContent = item.prompt;
  const meta = document.createElement("span");
  meta.className = "meta";
  const when = item.created_at ? new Date(item.created_at * 1000).toLocaleString() : "";
  meta.textContent = [item.status, item.size, when].filter(Boolean).join(" · ");
  button.append(prompt, meta);
  button.addEventListener("click", () => openItem(item));
  li.append(button);
  return li;
}

async function refreshRecent() {
  const res = await api(model.video ? "/v1/videos?limit=20" : "/v1/images?limit=20").catch(() => null);
  if (!res || !res.ok) return; // an engine without the list: the page works without it
  const items = (await res.json()).data;
  $("recent").replaceChildren(...items.map(recentItem));
  $("recent-empty").hidden = items.length > 0;
}

async function start() {
  $("generate").addEventListener("submit", generate);
  try {
    await loadModel();
    await refreshRecent();
  } catch (e) {
    showError(e.message);
  }
}

start();
