"""Answers sent before the body is read (413, 401, 404) reach clients that write their whole body first.

Python's ``urllib`` sends the whole body before it reads anything (without the fix it got "Connection reset
by peer"); ``http.client`` (under ``requests``), ``requests`` and ``httpx`` are checked too, and ``curl``,
which asks ``Expect: 100-continue``. Each gets the router's JSON error, for bodies just over
``--max-body-bytes`` and far over it, and a kept connection serves its next request.
"""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import urllib.error
import urllib.request

import httpx
import pytest

from conftest import SHARED_API_KEY as KEY

LIMIT = 1 << 20  # the default --max-body-bytes
SIZES = {"just-over": LIMIT + 100_000, "8MB": 8 << 20, "40MB": 40 << 20}


@pytest.fixture(scope="module")
def engine(keyed_engine):
    return keyed_engine


def _body(size: int) -> bytes:
    prompt = "x" * (size - 20)
    return json.dumps({"prompt": prompt}).encode()


def _urllib(url: str, body: bytes, headers: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"content-type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _http_client(url: str, body: bytes, headers: dict) -> tuple[int, dict]:
    host, port = url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", "/" + url.split("/", 3)[3], body=body,
                     headers={"content-type": "application/json", **headers})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def _httpx(url: str, body: bytes, headers: dict) -> tuple[int, dict]:
    r = httpx.post(url, content=body, headers={"content-type": "application/json", **headers}, timeout=120)
    return r.status_code, r.json()


def _requests(url: str, body: bytes, headers: dict) -> tuple[int, dict]:
    requests = pytest.importorskip("requests")
    r = requests.post(url, data=body, headers={"content-type": "application/json", **headers}, timeout=120)
    return r.status_code, r.json()


def _curl(url: str, body: bytes, headers: dict) -> tuple[int, dict]:
    """curl sends ``Expect: 100-continue`` for a large body and waits: it is answered before sending any."""
    if shutil.which("curl") is None:
        pytest.skip("no curl on this machine")
    args = ["curl", "-s", "-w", "\n%{http_code}", "-H", "content-type: application/json", "--data-binary", "@-"]
    for k, v in headers.items():
        args += ["-H", f"{k}: {v}"]
    out = subprocess.run([*args, url], input=body, capture_output=True, timeout=120, check=True).stdout
    text, _, code = out.decode().rpartition("\n")
    return int(code), json.loads(text)


CLIENTS = {"urllib": _urllib, "curl": _curl, "http.client": _http_client, "httpx": _httpx, "requests": _requests}
CASES = {  # path, headers, expected status and error type
    "413": ("/generate", {"authorization": f"Bearer {KEY}"}, 413, "body_too_large"),
    "401": ("/generate", {}, 401, "unauthorized"),
    "404": ("/no/such/path", {"authorization": f"Bearer {KEY}"}, 404, "not_found"),
}


# 413 at every size; the answers that do not depend on the size at one
COMBINATIONS = [(case, client, size) for case in CASES for client in CLIENTS for size in SIZES
                if case == "413" or size == "8MB"]


@pytest.mark.parametrize("case, client, size", COMBINATIONS, ids=["-".join(c) for c in COMBINATIONS])
def test_an_early_answer_reaches_the_client(engine, case, client, size):
    path, headers, status, type_ = CASES[case]
    got_status, body = CLIENTS[client](engine.url + path, _body(SIZES[size]), headers)
    assert (got_status, body["error"]["type"]) == (status, type_)
    if status == 413:
        assert body["error"]["field"] == "body"


def test_the_connection_serves_the_next_request_after_an_early_answer(engine):
    with httpx.Client(base_url=engine.url, headers={"authorization": f"Bearer {KEY}"}, timeout=120) as c:
        assert c.post("/generate", content=_body(SIZES["8MB"]),
                      headers={"content-type": "application/json"}).status_code == 413
        r = c.post("/generate", json={"prompt": "a fox", "num_inference_steps": 2, "output_type": "latent"})
        assert r.status_code == 200 and r.json()["attempts"] == 1
