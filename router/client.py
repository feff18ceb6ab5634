"""A small Python client for the router's HTTP API.

Responses come back with every tensor body decoded into a torch tensor.
Needs only httpx, msgpack and torch (not the engine's server dependencies).
"""

from __future__ import annotations

import base64
import io
import json
import os
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import httpx
import msgpack
import torch

from common.protocol.http_tensors import decode_tensors, tensor_to_body

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
        self._buckets: dict = {}  # (shm prefix, module) -> the weight buckets of the last update, reused

    def close(self) -> None:
        """Also removes the shared-memory buckets kept for weight updates."""
        for written in self._buckets.values():
            written.close()
        self._buckets.clear()
        self._http.close()

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _post(self, path: str, body: dict[str, Any], request_id: str | None = None) -> dict[str, Any]:
        headers = {"accept": MSGPACK} if self.binary else {}
        if request_id is not None:  # X-Request-Id: GET /progress/{id}, POST /abort_request
            headers["x-request-id"] = request_id
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

    def _get(self, path: str, params: dict[str, str] | None = None) -> dict[str, Any]:
        return self._decode(self._http.get(path, params=params))

    def _post_msgpack(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """A body with raw bytes (an adapter's tensors): msgpack, never pickle."""
        return self._decode(self._http.post(path, content=msgpack.packb(body, use_bin_type=True),
                                            headers={"content-type": MSGPACK}))

    def _stream(self, path: str, body: dict[str, Any], request_id: str | None) -> Iterator[dict[str, Any]]:
        headers = {"accept": MSGPACK, "content-type": "application/json"}
        if request_id is not None:
            headers["x-request-id"] = request_id
        with self._http.stream("POST", path, content=json.dumps(body), headers=headers) as r:
            if r.status_code >= 400:
                r.read()
                self._decode(r)
            unpacker = msgpack.Unpacker(raw=False)
            for chunk in r.iter_bytes():
                unpacker.feed(chunk)
                for item in unpacker:
                    yield decode_tensors(item)

    def health(self) -> dict[str, Any]:
        r = self._http.get("/health")
        return r.json()

    def model(self) -> dict[str, Any]:
        """The served model (GET /v1/models' entry): its family, defaults, ``image_input`` and ``max_images``
        (how many images ``image`` may hold)."""
        return self._get("/v1/models")["data"][0]

    def max_images(self) -> int:
        """How many images the served model takes in ``image`` (0: none, 1: one, more: a list of up to that)."""
        return self.model()["max_images"]

    def generate(self, prompt: str, request_id: str | None = None, **fields: Any) -> dict[str, Any]:
        """POST /generate; ``samples[i]["output"]`` is a torch tensor (a model with sound: ``samples[i]["audio"]``
        too, [channels, samples] at ``samples[i]["sample_rate"]``). ``image`` / ``last_image``
        (image-to-video, edits) may be a PIL image, an image file's bytes or path, or a base64 string;
        ``image`` a list of those too (models that take several: :meth:`max_images`)."""
        return self._post("/generate", {"prompt": prompt, **_images(fields)}, request_id)

    def rollout(self, prompt: str, request_id: str | None = None, **fields: Any) -> dict[str, Any]:
        """POST /rollout/generate; per sample: ``log_probs``, ``log_prob_steps`` and, with
        ``return_trajectory=True``, ``trajectory`` {latents, timesteps, sigmas} as torch tensors; with
        ``return_kl=True``, ``kl`` and ``ref_log_probs`` (docs/rollout.md, KL against a reference);
        ``initial_latents`` (resuming) may be a torch tensor [n or 1, *latent]."""
        latents = fields.get("initial_latents")
        if isinstance(latents, torch.Tensor):
            fields = {**fields, "initial_latents": tensor_to_body(latents.detach().cpu().contiguous(), binary=False)}
        return self._post("/rollout/generate", {"prompt": prompt, **_images(fields)}, request_id)

    def stream(self, prompt: str, rollout: bool = True, request_id: str | None = None,
               **fields: Any) -> Iterator[dict[str, Any]]:
        """``stream: true`` on /rollout/generate (``rollout=False``: /generate): each sample as it is decoded,
        ``{"index": i, ...}`` with torch tensors, then the request's ``{"done": true, ...}`` (docs/api.md,
        streaming). A failure after the first sample is the last item's ``error``."""
        yield from self._stream("/rollout/generate" if rollout else "/generate",
                                {"prompt": prompt, **_images(fields), "stream": True}, request_id)

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> list[str]:
        """POST /abort_request: cancel the request sent with ``request_id=rid`` (or every one: ``abort_all``,
        the admin key's); the ids cancelled."""
        return self._post("/abort_request", {"abort_all": True} if abort_all else {"rid": rid})["aborted"]

    def update_weights_from_disk(self, path: str, module: str = "transformer", checksum: bool = True) -> dict[str, Any]:
        """Load new weights into every denoise worker; returns the new ``weight_version``."""
        return self._post("/update_weights_from_disk", {"path": str(path), "module": module, "checksum": checksum})

    def pin_reference(self) -> dict[str, Any]:
        """Every denoise worker's current weights as ``kl_reference: "pinned"``; returns the pinned
        ``weight_version``."""
        return self._post("/pin_reference", {})

    def weights_checksum(self, module: str = "transformer") -> dict[str, Any]:
        return self._get("/weights_checksum", {"module": module})

    # --- releasing and resuming the weights (a colocated trainer) -------------------------
    def release_memory_occupation(self, tags: list[str] | None = None, level: int = 2,
                                  mode: str = "wait") -> dict[str, Any]:
        """Release the tagged components' weights (``transformer``, ``text_encoder``, ``vae``, ``weights``;
        None: all): level 1 to host memory, level 2 dropped. ``mode="abort"``: the work in flight on their
        workers is answered 503 instead of finishing first."""
        return self._post("/release_memory_occupation", {"tags": tags, "level": level, "mode": mode})

    def resume_memory_occupation(self, tags: list[str] | None = None, reload: str | None = None) -> dict[str, Any]:
        """Wake the tagged components. Weights dropped at level 2 must have been pushed since, or
        ``reload="disk"`` loads them from the model directory (else ``EngineHTTPError`` 409 ``weights_missing``)."""
        return self._post("/resume_memory_occupation", {"tags": tags, "reload": reload})

    def is_sleeping(self) -> dict[str, Any]:
        """``{"is_sleeping": bool, "components": {tag: {"sleeping", "level", "weights"}}}``."""
        return self._get("/is_sleeping")

    # --- LoRA adapters -----------------------------------------------------------------
    def load_lora_adapter(self, lora_name: str, lora_path: str, load_into_transformer_2: bool = False) -> dict:
        """Load (or replace) an adapter from a diffusers LoRA file/folder or a peft folder below the
        engine's --weight-root; returns its ``lora_version``, rank, target modules and sha256."""
        return self._post("/v1/load_lora_adapter", {"lora_name": lora_name, "lora_path": str(lora_path),
                                                    "load_into_transformer_2": load_into_transformer_2})

    def load_lora_adapter_from_tensors(self, lora_name: str, state_dict: dict[str, torch.Tensor], rank: int,
                                       alpha: float | None = None, module: str = "transformer") -> dict:
        """Load (or replace) an adapter straight from the trainer's memory, no file.

        ``state_dict``: ``<module path>.lora_A.weight`` / ``.lora_B.weight`` tensors, as peft's
        ``get_peft_model_state_dict(transformer)`` gives them, for expert ``module``. They travel as
        one flat blob of raw bytes in a msgpack body (no pickle); alpha None means alpha = rank.
        """
        names = sorted(state_dict)
        parts = [state_dict[n].detach().to("cpu") for n in names]
        dtype = parts[0].dtype if len({t.dtype for t in parts}) == 1 else torch.float32
        blob = torch.cat([t.to(dtype).reshape(-1) for t in parts])
        body = {"lora_name": lora_name, "tensors": [{"name": n, "shape": list(t.shape)} for n, t in zip(names, parts)],
                "blob": tensor_to_body(blob, binary=True), "rank": rank, "alpha": alpha, "module": module}
        return self._post_msgpack("/v1/load_lora_adapter", body)

    def unload_lora_adapter(self, lora_name: str) -> dict:
        return self._post("/v1/unload_lora_adapter", {"lora_name": lora_name})

    def lora_adapters(self) -> list[dict]:
        """Each loaded adapter: lora_name, lora_version, rank, scale, target_modules, experts, sha256."""
        return self._get("/v1/lora_adapters")["adapters"]

    # --- weight sync from the trainer's memory (--weight-sync-from-memory) ---------------
    def weight_sync_info(self) -> dict:
        """Whether the engine takes weights from memory, the shared-memory prefix, the denoise workers."""
        return self._get("/weight_sync")

    def update_weights_from_tensors(self, named_tensors, module: str = "transformer",
                                    bucket_bytes: int = 256 << 20, checksum: bool = True,
                                    lora: dict | None = None) -> dict[str, Any]:
        """Load the trainer's tensors into every denoise worker of this host from memory (no disk).

        ``named_tensors``: a module (its ``state_dict()``), a mapping or (name, tensor) pairs. They are written
        once into buckets of at most ``bucket_bytes``, which every worker copies from: shared-memory segments,
        or, when they all lie on one GPU and the engine's denoise workers are GPU workers of this host
        (``weight_sync_info()["cuda_ipc"]``), buffers on that GPU handed over as CUDA IPC handles. The client
        keeps the buckets for its next update of the same layout and frees them on ``close()`` (the launcher
        removes leftover segments of its engine).
        All or nothing: a wrong name, shape or dtype changes no weight (400). Returns the new
        ``weight_version`` and the workers' ``sha256`` (``state_dict_checksum`` of what they now hold;
        None with ``checksum=False``, which spares the workers a pass over the weights).

        ``lora={"lora_name": ..., "rank": r, "alpha": a}``: the tensors are instead a LoRA adapter of
        ``module`` (peft names, ``...lora_A.weight``), loaded as ``lora_name``; the answer is the adapter's
        (its new ``lora_version`` and sha256), as for ``load_lora_adapter``.
        """
        from common.diffusion import weight_buckets

        info = self.weight_sync_info()
        named = weight_buckets.named_tensors(named_tensors)
        entries, sizes = weight_buckets.plan(named, bucket_bytes)
        gpu = _one_gpu(named) if info.get("cuda_ipc") else None
        if gpu is None and not info.get("shm_prefix"):
            raise RuntimeError("this engine takes no shared-memory weights (tcp transport): use a weights group")
        key = (info["shm_prefix"], gpu, module, None if lora is None else lora["lora_name"])
        written = self._buckets.pop(key, None)
        if written is None or written.sizes != sizes:
            if written is not None:
                written.close()
            written = _new_buckets(info["shm_prefix"], sizes, gpu)
        try:
            weight_buckets.pack_into(written.buffers, entries, dict(named))
            reply = self._post("/update_weights_from_tensors", {
                "module": module, "checksum": checksum, "tensors": [_plain(e) for e in entries],
                "buckets": [_plain(b) for b in written.buckets()], **_lora_field(lora)})
        except BaseException:
            written.close()
            raise
        self._buckets[key] = written  # the next update of this layout rewrites the same segments
        return reply

    def init_weights_group(self, master_address: str, master_port: int, backend: str = "gloo",
                           timeout_s: float = 600.0) -> dict[str, Any]:
        """Have every denoise worker join the trainer's torch.distributed group (returns once all joined).
        The trainer must create its rank-0 side at the same time: use ``rl.WeightsGroup``, which does both."""
        return self._post("/init_weights_group", {"master_address": master_address, "master_port": master_port,
                                                  "backend": backend, "timeout_s": timeout_s})

    def update_weights_from_distributed(self, module: str, tensors: list, bucket_sizes: list[int],
                                        checksum: bool = True, lora: dict | None = None) -> dict[str, Any]:
        """Announce an update the trainer broadcasts bucket by bucket (``tensors``: the layout's entries);
        returns once every worker applied it (or none did). ``lora``: as for ``update_weights_from_tensors``."""
        return self._post("/update_weights_from_distributed", {
            "module": module, "checksum": checksum, "tensors": [_plain(e) for e in tensors],
            "buckets": [{"nbytes": n} for n in bucket_sizes], **_lora_field(lora)})

    def destroy_weights_group(self) -> dict[str, Any]:
        return self._post("/destroy_weights_group", {})


def _one_gpu(named: list) -> "torch.device | None":
    """The GPU every tensor lies on, if they all lie on the same one."""
    devices = {t.device for _, t in named}
    return next(iter(devices)) if len(devices) == 1 and next(iter(devices)).type == "cuda" else None


def _new_buckets(shm_prefix: str | None, sizes: list[int], gpu):
    if gpu is not None:
        from common.transport.weight_handles import DeviceBuckets

        return DeviceBuckets(sizes, gpu)
    from common.transport.weight_segments import WrittenBuckets

    return WrittenBuckets(shm_prefix, sizes)


def _lora_field(lora: dict | None) -> dict:
    return {} if lora is None else {"lora": dict(lora)}


def _plain(struct) -> dict:
    import msgspec

    return msgspec.to_builtins(struct)


def image_field(image: Any) -> str:
    """An image as the engine's ``image`` field: a PIL image (sent as PNG, lossless), an image file's bytes
    or path, or a string (base64 or a data: URL) as it is."""
    if isinstance(image, str):
        return image
    if hasattr(image, "save"):  # a PIL image
        out = io.BytesIO()
        image.save(out, format="PNG")
        image = out.getvalue()
    elif isinstance(image, (os.PathLike,)):
        image = Path(image).read_bytes()
    return base64.b64encode(bytes(image)).decode("ascii")


def _images(fields: dict[str, Any]) -> dict[str, Any]:
    def field(v):
        return [image_field(i) for i in v] if isinstance(v, (list, tuple)) else image_field(v)

    return {k: field(v) if k in ("image", "last_image") and v is not None else v for k, v in fields.items()}
