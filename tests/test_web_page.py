"""The web page at ``/`` and the API docs at ``/docs`` in a real browser: Playwright driving Debian's Chromium
(``/usr/bin/chromium``, installed by scripts/test.sh) with every request that would leave loopback aborted, so
whatever the pages need must come from the engine.

A video model (the built-in ``tiny``): the form starts from the model's defaults, a job's progress moves the
``<progress>`` bar, the MP4 plays and its download link serves it, recent jobs list their prompts as text (a
prompt of markup never runs), a bad size shows the engine's message; an engine with an API key asks for it;
``/docs`` renders its operations. An image model (``tiny-sd3``, heavy): the image, its progress, its list.
An edit model (heavy): the uploads go to ``/v1/images/edits`` as data: URLs in ``image``. A model with sound
(``tiny-ltx2``, heavy): its MP4 plays with its audio track, not muted. A model sized by its image
(``tiny-hunyuan-video15-i2v``, heavy): no size sent, the video the image's aspect.

``DISAGG_WEB_SCREENSHOT=path.png`` saves the page after a finished generation (docs/web-page.png is one).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

import pytest

from conftest import SHARED_API_KEY as API_KEY

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
# Without these Chromium reaches for the network (updates, sync, QUIC probes), which the engine's hosts lack.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
WAIT_MS = 120_000
VIDEO_READY = "() => { const v = document.getElementById('video'); return v.readyState >= 2 && v.duration > 0; }"
# Records every value the progress bar takes (its value attribute reflects the property the page sets).
WATCH_PROGRESS = """() => {
  window.__progress = [];
  const bar = document.getElementById("progress");
  new MutationObserver(() => window.__progress.push(bar.getAttribute("value")))
    .observe(bar, {attributes: true, attributeFilter: ["value"]});
}"""
MARKUP = '<script>window.__pwned=1</script> and <img src=x onerror="window.__pwned=1"> a fox'


@pytest.fixture(scope="module")
def browser():
    if not os.access(CHROMIUM, os.X_OK):
        why = f"no Chromium at {CHROMIUM} (Debian's chromium: scripts/test.sh installs it where apt-get can)"
        if os.environ.get("CI") == "true":
            pytest.fail(why + ": CI must run the browser tests")  # a skip there would hide a broken install
        pytest.skip(why)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Offline:
    """A browser context in which every request that would leave loopback is aborted (and recorded)."""

    def __init__(self, browser):
        self.left: list[str] = []  # what the pages tried to fetch from elsewhere: must stay empty
        self.errors: list[str] = []
        self.context = browser.new_context()
        self.context.route("**/*", self._route)

    def _route(self, route):
        url = urlparse(route.request.url)
        if url.scheme in ("http", "https", "ws", "wss") and url.hostname not in LOOPBACK:
            self.left.append(route.request.url)
            route.abort()
        else:
            route.continue_()

    def page(self):
        page = self.context.new_page()
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        return page


@pytest.fixture
def web(browser):
    w = Offline(browser)
    yield w
    w.context.close()
    assert w.left == [], f"the pages reached beyond loopback: {w.left}"
    assert w.errors == [], f"script errors: {w.errors}"


@pytest.fixture(scope="module")
def engine(shared_engine):
    # Shared: the video jobs made here stay listed on it, which no other module on it depends on (each finds
    # its own jobs by id, or the newest).
    return shared_engine("tiny")


def open_page(web, url: str):
    page = web.page()
    page.goto(url + "/")
    page.wait_for_selector("#submit:not([disabled])", timeout=WAIT_MS)
    return page


def fill(page, prompt: str, **fields) -> None:
    page.fill("#prompt", prompt)
    for name, value in fields.items():
        page.fill(f"#{name}", str(value))


def generate_video(page, prompt: str, **fields) -> None:
    fill(page, prompt, **fields)
    page.click("#submit")
    page.wait_for_function(VIDEO_READY, timeout=WAIT_MS)


def progress_seen(page) -> list[int]:
    """The values WATCH_PROGRESS recorded (an indeterminate bar, no value, left out)."""
    return [int(v) for v in page.evaluate("window.__progress") if v is not None]


def recent_prompts(page) -> list[str]:
    return page.eval_on_selector_all("#recent .prompt", "nodes => nodes.map(n => n.textContent)")


def downloaded(page) -> bytes:
    """What the download link's href serves (a blob: URL of the content the page fetched with the key)."""
    data = page.evaluate("async () => Array.from(new Uint8Array(await (await fetch("
                         "document.getElementById('download').href)).arrayBuffer()))")
    return bytes(data)


def test_the_form_starts_from_the_models_defaults(web, engine):
    model = engine.http.get("/v1/models").json()["data"][0]
    assert model["video"] is True and model["image_input"] == "none" and model["fps"] == 16
    page = open_page(web, engine.url)
    for name in ("width", "height", "num_frames", "num_inference_steps", "guidance_scale"):
        assert float(page.input_value(f"#{name}")) == model["defaults"][name], name
    assert page.is_visible("#num_frames") and not page.is_visible("#image")
    for name in ("prompt", "negative_prompt", "width", "height", "num_frames", "num_inference_steps", "seed",
                 "guidance_scale"):
        assert page.locator(f"label[for={name}]").count() == 1, name
    assert page.get_attribute("nav a", "href") == "/docs"


def test_a_video_job_moves_the_progress_bar_plays_and_downloads(web, engine):
    page = open_page(web, engine.url)
    page.evaluate(WATCH_PROGRESS)
    # Large enough, and enough steps, that polling sees the denoising under way.
    generate_video(page, "a red fox running through snow", width=128, height=128, num_frames=17,
                   num_inference_steps=40, seed=7)
    seen = progress_seen(page)
    assert seen[-1] == 100 and seen == sorted(seen), seen
    assert len({v for v in seen if v < 100}) >= 2 and any(0 < v < 100 for v in seen), seen
    assert page.evaluate("document.getElementById('video').videoWidth") == 128
    link = page.locator("#download")
    assert link.get_attribute("href").startswith("blob:") and link.get_attribute("download").endswith(".mp4")
    content = link.get_attribute("data-content")
    served = engine.http.get(content)
    assert served.status_code == 200 and served.headers["content-type"] == "video/mp4"
    assert downloaded(page) == served.content and served.content[4:8] == b"ftyp"
    assert recent_prompts(page)[0] == "a red fox running through snow"
    if os.environ.get("DISAGG_WEB_SCREENSHOT"):
        page.evaluate("document.getElementById('video').pause()")
        page.screenshot(path=os.environ["DISAGG_WEB_SCREENSHOT"], full_page=True)
    # A fresh load lists it too; a click shows it again.
    page.reload()
    page.wait_for_selector("#recent .prompt", timeout=WAIT_MS)
    assert recent_prompts(page)[0] == "a red fox running through snow"
    page.click("#recent .job >> nth=0")
    page.wait_for_function(VIDEO_READY, timeout=WAIT_MS)
    assert downloaded(page) == served.content


def test_a_prompt_of_markup_is_shown_as_text_and_never_runs(web, engine):
    page = open_page(web, engine.url)
    generate_video(page, MARKUP, num_inference_steps=2)
    page.reload()
    page.wait_for_selector("#recent .prompt", timeout=WAIT_MS)
    assert recent_prompts(page)[0] == MARKUP
    page.click("#recent .job >> nth=0")
    page.wait_for_function(VIDEO_READY, timeout=WAIT_MS)
    assert page.text_content("#result-prompt") == MARKUP
    assert page.evaluate("window.__pwned") is None
    assert page.locator("#recent script, #recent img, #result-prompt img").count() == 0


def test_a_bad_size_shows_the_engines_message(web, engine):
    page = open_page(web, engine.url)
    fill(page, "a fox", width=7)
    page.click("#submit")
    page.wait_for_selector("#error:not([hidden])", timeout=WAIT_MS)
    assert "width must be a positive multiple of 16, got 7" in page.text_content("#error")
    assert page.is_enabled("#submit")


def test_docs_render_offline(web, engine):
    page = web.page()
    page.goto(engine.url + "/docs")
    page.wait_for_selector(".opblock", timeout=WAIT_MS)
    assert page.locator(".opblock").count() >= 20
    assert page.locator(".opblock-summary-path", has_text="/v1/videos").count() >= 1


def test_an_engine_with_an_api_key_asks_for_it_then_works(web, keyed_engine):
    page = web.page()
    page.goto(keyed_engine.url + "/")
    page.wait_for_selector("label[for=api-key]", timeout=WAIT_MS)
    assert "needs an API key" in page.text_content("#key-form")
    page.fill("#api-key", "not-" + API_KEY)
    page.click("#key-form button")
    page.wait_for_function("() => document.getElementById('key-form')?.textContent.includes('refused')",
                           timeout=WAIT_MS)
    page.fill("#api-key", API_KEY)
    page.click("#key-form button")
    page.wait_for_selector("#submit:not([disabled])", timeout=WAIT_MS)
    assert page.text_content("#model").startswith("tiny")
    generate_video(page, "a keyed fox", num_inference_steps=2)
    served = keyed_engine.http.get(page.get_attribute("#download", "data-content"),
                                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert downloaded(page) == served.content and served.content[4:8] == b"ftyp"
    assert recent_prompts(page)[0] == "a keyed fox"
    # /docs in the same tab sends the stored key for its spec.
    page.goto(keyed_engine.url + "/docs")
    page.wait_for_selector(".opblock", timeout=WAIT_MS)
    # A new tab has no key: /docs asks for it.
    fresh = web.page()
    fresh.goto(keyed_engine.url + "/docs")
    fresh.wait_for_selector("label[for=api-key]", timeout=WAIT_MS)
    fresh.fill("#api-key", API_KEY)
    fresh.click("#key-form button")
    fresh.wait_for_selector(".opblock", timeout=WAIT_MS)


@pytest.mark.heavy
def test_an_image_model_shows_its_image_and_lists_it(web, engine_factory):
    eng = engine_factory("tiny-sd3")
    model = eng.http.get("/v1/models").json()["data"][0]
    assert model["video"] is False and model["image_input"] == "none"
    page = open_page(web, eng.url)
    assert not page.is_visible("#num_frames") and not page.is_visible("#image")
    page.evaluate(WATCH_PROGRESS)
    # Large enough that it runs for several of the page's polls (the denoise worker reports steps over time).
    fill(page, "a lighthouse <b>at dusk</b>", width=512, height=512, num_inference_steps=50)
    page.click("#submit")
    page.wait_for_function("() => { const i = document.getElementById('picture');"
                           " return !i.hidden && i.complete && i.naturalWidth === 512; }", timeout=WAIT_MS)
    seen = progress_seen(page)
    assert seen[-1] == 100 and seen == sorted(seen), seen
    if "/progress/{request_id}" in eng.http.get("/openapi.json").json()["paths"]:
        assert seen[0] < 100, seen  # GET /progress/{id}'s values while it ran (without it: indeterminate)
    png = downloaded(page)
    assert png.startswith(b"\x89PNG") and page.get_attribute("#download", "download").endswith(".png")
    page.reload()
    page.wait_for_selector("#recent .prompt", timeout=WAIT_MS)
    assert recent_prompts(page)[0] == "a lighthouse <b>at dusk</b>"
    page.click("#recent .job >> nth=0")
    page.wait_for_function("() => document.getElementById('download').download.startsWith('img_')",
                           timeout=WAIT_MS)
    assert downloaded(page) == png


@pytest.mark.heavy
def test_an_image_to_video_model_takes_the_uploaded_image(web, engine_factory, tmp_path):
    from PIL import Image

    eng = engine_factory("tiny-wan-i2v")
    model = eng.http.get("/v1/models").json()["data"][0]
    assert model["video"] is True and model["image_input"] == "required"
    page = open_page(web, eng.url)
    assert page.is_visible("#image") and page.text_content("label[for=image]") == "Input image (required)"
    fill(page, "a fox wakes up", num_inference_steps=2)
    page.click("#submit")  # no image: the engine says what is missing
    page.wait_for_selector("#error:not([hidden])", timeout=WAIT_MS)
    assert "makes videos from an image" in page.text_content("#error")
    first = tmp_path / "first.png"
    Image.new("RGB", (model["defaults"]["width"], model["defaults"]["height"]), (200, 40, 30)).save(first)
    page.set_input_files("#image", str(first))  # sent as the job's input_reference
    page.click("#submit")
    page.wait_for_function(VIDEO_READY, timeout=WAIT_MS)
    assert page.is_hidden("#error") and recent_prompts(page)[0] == "a fox wakes up"


# Plays the shown video a moment and reports whether its sound played: Chromium counts the audio it decodes.
PLAY_WITH_SOUND = """async () => {
  const v = document.getElementById('video');
  v.currentTime = 0;
  await v.play();
  await new Promise(r => setTimeout(r, 300));
  v.pause();
  return {muted: v.muted, volume: v.volume, audioBytes: v.webkitAudioDecodedByteCount};
}"""


@pytest.mark.heavy
def test_a_model_with_sound_plays_its_video_with_sound(web, engine_factory):
    """tiny-ltx2: the job's MP4 has an audio track, and the page's player plays it, not muted."""
    import io

    import av

    eng = engine_factory("tiny-ltx2")
    page = open_page(web, eng.url)
    generate_video(page, "a drum in the rain", num_inference_steps=2, seed=3)
    played = page.evaluate(PLAY_WITH_SOUND)
    assert played["muted"] is False and played["volume"] > 0 and played["audioBytes"] > 0, played
    served = eng.http.get(page.get_attribute("#download", "data-content"))
    with av.open(io.BytesIO(served.content)) as c:
        assert [s.type for s in c.streams] == ["video", "audio"]
    assert downloaded(page) == served.content

def test_static_files_ship_with_the_package():
    """What the pages load is inside the package (pyproject's package data), never from a CDN."""
    root = Path(__file__).resolve().parent.parent
    static = root / "router" / "api" / "static"
    import tomllib

    package_data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert {"static/*", "static/swagger/*"} <= set(package_data["router.api"])
    for name in ("index.html", "app.js", "key.js", "docs.js", "style.css", "swagger/swagger-ui-bundle.js",
                 "swagger/swagger-ui.css", "swagger/favicon-32x32.png", "swagger/LICENSE"):
        assert (static / name).is_file(), name
    for name in ("index.html", "app.js", "key.js", "docs.js", "style.css"):
        text = (static / name).read_text()
        assert "http://" not in text and "https://" not in text, name


@pytest.mark.heavy
def test_an_edit_model_sends_its_uploads_as_image(web, shared_engine, tmp_path):
    """An edit model that takes up to three images (tiny-qwen-image-edit-plus): the upload takes several files,
    sent to /v1/images/edits as data: URLs in image; one upload, and three, show /generate's pixels for the
    fields sent."""
    import json

    from PIL import Image

    eng = shared_engine("tiny-qwen-image-edit-plus")
    page = web.page()
    sent = []
    page.on("request", lambda req: sent.append(json.loads(req.post_data))
            if req.url.endswith("/v1/images/edits") else None)
    page.goto(eng.url + "/")
    page.wait_for_selector("#submit:not([disabled])", timeout=WAIT_MS)
    assert page.get_attribute("#image", "multiple") is not None
    assert page.text_content("label[for=image]") == "Input images (up to 3, required)"
    files = []
    for i, color in enumerate([(200, 40, 30), (30, 200, 40), (40, 30, 200)]):
        files.append(tmp_path / f"in{i}.png")
        Image.new("RGB", (40, 24), color).save(files[-1])
    assert page.input_value("#width") == "" and page.get_attribute("#width", "placeholder") == "auto"
    # The guidance input is the model's true_cfg_scale (its default, 4): with a negative prompt.
    fill(page, "the same at night", num_inference_steps=2, seed=5, width=48, height=32, negative_prompt="blurry")
    for upload in ([files[0]], files):
        page.set_input_files("#image", [str(f) for f in upload])
        page.click("#submit")
        page.wait_for_function("() => { const i = document.getElementById('picture');"
                               " return !i.hidden && i.complete && i.naturalWidth > 0; }", timeout=WAIT_MS)
        body = dict(sent[-1])
        images = body["image"] if isinstance(body["image"], list) else [body["image"]]
        assert len(images) == len(upload) and all(x.startswith("data:image/png;base64,") for x in images)
        assert body["true_cfg_scale"] == 4 and "guidance_scale" not in body  # the model's guidance field
        width, height = map(int, body.pop("size").split("x"))
        ref = eng.http.post("/generate", json={**body, "width": width, "height": height, "output_type": "png"})
        assert ref.status_code == 200, ref.text
        assert downloaded(page) == ref.content  # the same PNG encoder over the same pixels
        page.evaluate("() => { document.getElementById('picture').hidden = true; }")


@pytest.mark.heavy
def test_a_model_sized_by_its_image_sends_no_size(web, engine_factory, tmp_path):
    """HunyuanVideo 1.5 image to video (``sized_by_image``: the aspect bucket nearest the image, a size refused):
    the size inputs say auto and the job is sent without one; a portrait image makes a portrait video, as
    ``/generate`` makes it for that image."""
    from PIL import Image

    eng = engine_factory("tiny-hunyuan-video15-i2v")
    model = eng.http.get("/v1/models").json()["data"][0]
    assert model["video"] is True and model["sized_by_image"] is True and model["image_input"] == "required"
    page = open_page(web, eng.url)
    assert page.get_attribute("#width", "placeholder") == "auto" and page.input_value("#width") == ""
    first = tmp_path / "portrait.png"
    Image.new("RGB", (48, 96), (30, 90, 200)).save(first)
    fill(page, "a fox looks up", num_inference_steps=2)
    page.set_input_files("#image", str(first))
    page.click("#submit")
    page.wait_for_function(VIDEO_READY, timeout=WAIT_MS)
    assert page.is_hidden("#error")
    size = page.evaluate("() => { const v = document.getElementById('video');"
                         " return [v.videoWidth, v.videoHeight]; }")
    import base64

    from common.protocol.http_tensors import body_to_tensor

    png = base64.b64encode(first.read_bytes()).decode()
    r = eng.http.post("/generate", json={"prompt": "a fox looks up", "num_inference_steps": 2, "image": png})
    assert r.status_code == 200, r.text
    frames = body_to_tensor(r.json()["samples"][0]["output"])  # [F, H, W, 3]
    assert size[1] > size[0] and [frames.shape[2], frames.shape[1]] == size, (size, frames.shape)
