"""A small Python client for the router's HTTP API.

Responses come back with every tensor body decoded into a torch tensor.
Needs only httpx, msgpack and torch (not the engine's server dependencies).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import msgpack

from common.protocol.http_tensors import decode_tensors

MSGPACK = "application/msgpack"


class EngineHTTPError(RuntimeError):
    def __init__(self, status: int, error: dict):
        super().__init__(f"HTTP {status}: {error.get('type')}: {error.get('message')}")
        self.status, self.error = status, error


class EngineClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", binary: bool = True, timeout: float = 600.0,
                 api_key: str | None = None):
        """``api_key``: sent as ``Authorization: Bearer <key>`` (the API key, or the admin key for weight updates)."""
        self.base_url = base_url.rstrip("/")
        self.binary = binary
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, headers=headers)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        headers = {"accept": MSGPACK} if self.binary else {}
        r = self._http.post(path, content=json.dumps(body), headers={**headers, "content-type": "application/json"})
        return self._decode(r)

    def _decode(self, r: httpx.Response) -> dict[str, Any]:
        if r.headers.get("content-type", "").startswith(MSGPACK):
            data = msgpack.unpackb(r.content, raw=False)
        else:
            data = r.json()
        if r.status_code >= 400:
            raise EngineHTTPError(r.status_code, data.get("error", {}) if isinstance(data, dict) else {})
        return decode_tensors(data)

    def health(self) -> dict[str, Any]:
        return self._http.get("/health").json()

    def generate(self, prompt: str, **fields: Any) -> dict[str, Any]:
        """POST /generate; ``samples[i]["output"]`` is a torch tensor."""
        return self._post("/generate", {"prompt": prompt, **fields})

    def rollout(self, prompt: str, **fields: Any) -> dict[str, Any]:
        """POST /rollout/generate; per sample: ``log_probs``, ``log_prob_steps`` and, with
        ``return_trajectory=True``, ``trajectory`` {latents, timesteps, sigmas} as torch tensors."""
        return self._post("/rollout/generate", {"prompt": prompt, **fields})

    def update_weights_from_disk(self, path: str, module: str = "transformer") -> dict[str, Any]:
        """Load new weights into every denoise worker; returns the new ``weight_version``."""
        return self._post("/update_weights_from_disk", {"path": str(path), "module": module})

    def weights_checksum(self, module: str = "transformer") -> dict[str, Any]:
        return self._decode(self._http.get("/weights_checksum", params={"module": module}))
