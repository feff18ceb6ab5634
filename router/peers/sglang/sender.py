"""The trainer's side of SGLang's tensor updates, for rollout clients written against SGLang diffusion.

SGLang diffusion's ``/update_weights_from_tensor`` carries the tensors pickled (torch's multiprocessing
reductions of CUDA IPC handles), which this engine never unpickles. :class:`SGLangWeightSender` sends the same
named tensors through the engine's own memory transports (shared memory, or CUDA IPC handles as plain fields)
and answers as SGLang does. In a miles or UniRL rollout client, the one line that posts the pickled payload::

    requests.post(f"{url}/update_weights_from_tensor", json={"serialized_named_tensors": [...], ...})

becomes::

    SGLangWeightSender(url).update_weights_from_tensor(named_tensors, target_modules=["transformer"])

(``from router.peers.sglang.sender import SGLangWeightSender``; the engine's Python client beside it.)
"""

from __future__ import annotations

from typing import Any

from router.client import EngineClient, EngineHTTPError

EXPERTS = ("transformer", "transformer_2")


class SGLangWeightSender:
    """SGLang's ``update_weights_from_tensor`` call, through ``/update_weights_from_tensors`` (same host)."""

    def __init__(self, base_url: str, timeout: float = 600.0):
        self.client = EngineClient(base_url.rstrip("/").removesuffix("/sglang"), timeout=timeout)

    def update_weights_from_tensor(self, named_tensors, target_modules: list[str] | None = None,
                                   weight_update_mode: str | None = None, lora_name: str = "sglang",
                                   lora_rank: int | None = None, lora_alpha: float | None = None,
                                   **_sglang_only: Any) -> dict[str, Any]:
        """``named_tensors``: (name, tensor) pairs or a mapping, as SGLang's caller passes them before
        serializing; ``target_modules``: one expert (default the transformer); ``weight_update_mode="lora"``: the
        tensors are a LoRA adapter (peft names), loaded as ``lora_name``. SGLang's other arguments
        (``load_format``, ``payload_gpu_uuids``, ``flush_cache``) have no use here. Returns ``{"success",
        "message"}`` (a refused update: success false, the engine's message)."""
        modules = target_modules or ["transformer"]
        if len(modules) != 1 or modules[0] not in EXPERTS:
            return {"success": False, "message": f"target_modules: one of {EXPERTS}, got {modules}"}
        lora = None
        if weight_update_mode == "lora":
            lora = {"lora_name": lora_name, "rank": lora_rank, "alpha": lora_alpha}
        try:
            done = self.client.update_weights_from_tensors(named_tensors, module=modules[0], checksum=False, lora=lora)
        except EngineHTTPError as e:
            return {"success": False, "message": str(e)}
        version = done.get("lora_version", done.get("weight_version"))
        return {"success": True, "message": f"Updated {modules[0]} (version {version}).", **done}

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> "SGLangWeightSender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
