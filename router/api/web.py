"""The web page at ``/`` and the API docs at ``/docs``, both from files inside the package (``router/api/static/``).

Nothing comes from the network: the engine often runs where there is none. The page is plain HTML, CSS and
JavaScript (no build step) over the OpenAI-style endpoints; ``/docs`` is Swagger UI from the vendored
``swagger-ui-dist`` files in ``router/api/static/swagger/`` (its LICENSE beside them). Neither holds any data, so
both load without the API key (router/api/auth.py); the data they show comes from endpoints that need it, and both
send the key the page stored (``static/key.js``) as ``Authorization: Bearer``.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent / "static"
STATIC_PREFIX = "/static"
SWAGGER_JS = f"{STATIC_PREFIX}/swagger/swagger-ui-bundle.js"
# Loaded right after Swagger UI's bundle, before FastAPI's inline script creates the UI: it adds the key.
DOCS_SCRIPTS = f'<script src="{STATIC_PREFIX}/key.js"></script><script src="{STATIC_PREFIX}/docs.js"></script>'


def docs_html(title: str, openapi_url: str) -> str:
    """FastAPI's Swagger UI page over the local files, with the script that sends the stored API key."""
    html = get_swagger_ui_html(
        openapi_url=openapi_url, title=f"{title} - API docs", swagger_js_url=SWAGGER_JS,
        swagger_css_url=f"{STATIC_PREFIX}/swagger/swagger-ui.css",
        swagger_favicon_url=f"{STATIC_PREFIX}/swagger/favicon-32x32.png",
        swagger_ui_parameters={"validatorUrl": None}).body.decode()
    tag = f'<script src="{SWAGGER_JS}"></script>'
    if html.count(tag) != 1:  # FastAPI changed its template: fail at start, not with a page that lacks the key
        raise RuntimeError(f"Swagger UI page without exactly one {tag!r}")
    return html.replace(tag, tag + DOCS_SCRIPTS)


def add_web_routes(app: FastAPI) -> None:
    """``/`` (the page), ``/static/...`` and ``/docs``; create the app with ``docs_url=None, redoc_url=None``."""
    docs = docs_html(app.title, app.openapi_url)
    app.mount(STATIC_PREFIX, StaticFiles(directory=STATIC_DIR), name="static")
    app.add_api_route("/", lambda: FileResponse(STATIC_DIR / "index.html"), methods=["GET"],
                      include_in_schema=False)
    app.add_api_route("/docs", lambda: HTMLResponse(docs), methods=["GET"], include_in_schema=False)
