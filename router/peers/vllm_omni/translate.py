"""A vLLM-Omni ``RolloutGenerateRequest`` as the engine's own ``/rollout/generate`` body, and what its answer
needs to know. Pure: no HTTP, no I/O.

``sampling_params`` holds ``OmniDiffusionSamplingParams``' fields (vllm_omni/inputs/data.py). Each JSON-usable
field is either mapped to the native field of the same meaning (:data:`NATIVE`), accepted and ignored because
it changes nothing this route answers (:data:`IGNORED`), or accepted at its default only: a feature of some
vLLM-Omni pipeline this engine does not have (:data:`DEFAULT_ONLY`). The fields some model family declares
under the same name (a second expert's guidance, the frame rate, ...) go to the served family's field, and are
accepted unset elsewhere. Anything else is a 400 naming ``sampling_params.KEY``, as the peer's ``TypeError``.
The rollout's own settings (the SDE, its steps, the KL, ...) come in ``sampling_params.extra_args``, the peer's
free dict of pipeline knobs (:data:`EXTRA_NATIVE`, and the served family's own fields).
"""

from __future__ import annotations

import re
import secrets
import uuid
from dataclasses import dataclass, field

from common.diffusion.model_info import ModelInfo
from common.diffusion.request_fields import declared
from common.families import BINDINGS
from router.api.request_ids import REQUEST_ID
from router.core.errors import FieldError
from router.peers.vllm_omni.schemas import OmniRolloutRequest

STAGE_ID = 0
ONE_STAGE = f"this engine serves one diffusion stage, {STAGE_ID}"
SP = "sampling_params"

# The peer's field -> the native field of the same meaning.
NATIVE = {"seed": "seed", "num_outputs_per_prompt": "n", "num_inference_steps": "num_inference_steps",
          "guidance_scale": "guidance_scale", "height": "height", "width": "width", "num_frames": "num_frames",
          "sigmas": "sigmas", "timesteps": "timesteps", "max_sequence_length": "max_sequence_length",
          "lora_scale": "lora_scale"}
# No effect on what this route answers (latents, timesteps and log-probs; never frames or files): any value.
IGNORED = frozenset({
    "generator_device",  # the engine draws every noise with a CPU generator
    "guidance_scale_provided", "guidance_scale_2_provided",  # a scale given is always used
    "do_classifier_free_guidance",  # follows the guidance scale, as the pipelines decide it
    "output_type", "save_output", "return_frames", "quality", "fps",  # the decoded output's (fps: see rate_field)
    "enable_frame_interpolation", "frame_interpolation_exp", "frame_interpolation_scale",
    "frame_interpolation_model_path", "return_trajectory_decoded",
    "return_trajectory_latents", "return_trajectory_handles",  # the route always returns the trajectory
    "profile", "num_profiled_timesteps", "debug", "height_not_provided", "width_not_provided",
    "num_frames_round_down", "is_prompt_processed", "use_en_prompt",
})
QUALITY = (None, "lossless", "high")  # validated as the peer's __post_init__ does
# Features of some vLLM-Omni pipelines (or engine-internal state) this engine lacks: their default value only.
DEFAULT_ONLY = {
    "prompt_template": None, "layers": 4, "cfg_normalize": False, "resolution": 640, "eta": 0.0, "strength": None,
    "boundary_ratio": None, "timestep": None, "step_index": None, "n_tokens": None, "extra_step_kwargs": {},
    "generator": None, "latents": None, "audio_latents": None, "raw_latent_shape": None, "noise_pred": None,
    "image_latent": None, "height_latents": None, "width_latents": None, "past_key_values": None,
    "kv_metadata": None, "need_kv_receive": True, "cfg_text_past_key_values": None, "cfg_img_past_key_values": None,
    "cfg_text_kv_metadata": None, "cfg_img_kv_metadata": None, "cfg_kv_request_ids": None,
    "cfg_active_branch": None, "cfg_branch_roles": None, "cfg_branch_past_key_values": None,
    "cfg_branch_kv_metadata": None, "modules": {}, "trajectory_timesteps": None, "trajectory_latents": None,
    "lora_request": None, "STA_param": None, "is_cfg_negative": False, "mask_search_final_result_pos": None,
    "mask_search_final_result_neg": None, "VSA_sparsity": 0.0, "output": None,
}
# extra_args: the native /rollout/generate fields a vLLM-Omni body has no field for (docs/api.md).
EXTRA_NATIVE = frozenset({"sde_type", "noise_level", "sde_step_indices", "sde_window_size", "sde_window_range",
                          "ode_solver", "schedule", "return_kl", "kl_reference", "initial_noise_seed",
                          "share_prefix", "sde_streams", "mu", "lora_name", "timeout_s", "cache", "image",
                          "last_image"})
FAMILY_FIELDS = frozenset(f.name for b in BINDINGS.values() for f in b.request_fields)


@dataclass(frozen=True)
class Plan:
    """What the answer is built from besides the native outcome."""

    request_id: str
    seed: int
    n: int
    kl: bool  # extra_args.return_kl: the kl and ref_log_probs handles too
    names: dict[str, str] = field(default_factory=dict)  # native field -> the peer's (errors)

    def peer_field(self, native: str | None) -> str | None:
        """The peer's name of a native field a check refused (its first part: ``sde_step_indices.0``)."""
        if native is None:
            return None
        head = re.match(r"[A-Za-z0-9_]*", native).group()
        return self.names.get(head, head) + native[len(head):]


def check_stage(field_name: str, value: int | None) -> None:
    if value is not None and value != STAGE_ID:
        raise FieldError(field_name, f"no stage {value}; {ONE_STAGE}")


def check_stages(field_name: str, values: list[int] | None) -> None:
    for value in values or ():
        check_stage(field_name, value)


def rate_field(info: ModelInfo) -> str | None:
    """The served family's field the peer's ``fps`` sets when the body does not give that field itself (the
    peer's ``resolved_frame_rate``): the one that declares ``fps`` as its alias, if any."""
    field = declared(info.family.request_fields, "fps")
    return None if field is None else field.name


def _is_default(value, default) -> bool:
    return value == default and isinstance(value, bool) == isinstance(default, bool)


def native_body(req: OmniRolloutRequest, info: ModelInfo) -> tuple[dict, Plan]:
    """The native body (a dict for :class:`RolloutBody`) of ``req`` and its :class:`Plan`."""
    check_stage("stage_id", req.stage_id)
    rid = req.request_id or f"rollout-{uuid.uuid4().hex}"
    if not REQUEST_ID.fullmatch(rid):
        raise FieldError("request_id", f"must be 1-64 characters of A-Z a-z 0-9 _ . -, got {rid[:80]!r}")
    own = {f.name for f in info.family.request_fields}
    sp = dict(req.sampling_params)
    body: dict = {"prompt": req.prompt, "rollout": True, "return_trajectory": True, "output_type": "latent"}
    names = {"prompt": "prompt", "negative_prompt": "negative_prompt"}
    if req.negative_prompt is not None:
        body["negative_prompt"] = req.negative_prompt
    for key, value in sp.items():
        where = f"{SP}.{key}"
        if key in NATIVE:
            if value is not None:
                body[NATIVE[key]], names[NATIVE[key]] = value, where
        elif key == "extra_args":
            continue
        elif key in IGNORED:
            if key == "quality" and value not in QUALITY:
                raise FieldError(where, f"quality must be one of ['lossless', 'high'], got {value!r}")
        elif key in DEFAULT_ONLY:
            if not _is_default(value, DEFAULT_ONLY[key]):
                raise FieldError(where, f"not supported by this engine: only its default "
                                        f"{DEFAULT_ONLY[key]!r} is accepted (docs: vLLM-Omni's RL API)")
        elif key in own:
            if value is not None:
                body[key], names[key] = value, where
        elif key in FAMILY_FIELDS:
            if value not in (None, 0):
                raise FieldError(where, f"{info.family.pipeline} takes no {key}")
        else:
            raise FieldError(where, f"unexpected keyword argument {key!r}: not a field of "
                                    "OmniDiffusionSamplingParams (the rollout's settings go in extra_args)")
    rate = rate_field(info)
    if rate is not None and rate not in body and sp.get("fps") is not None:
        fps = sp["fps"]
        body[rate], names[rate] = float(fps) if type(fps) is int else fps, f"{SP}.fps"
    extra = sp.get("extra_args")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise FieldError(f"{SP}.extra_args", f"must be an object, got {type(extra).__name__}")
    for key, value in extra.items():
        where = f"{SP}.extra_args.{key}"
        if key not in EXTRA_NATIVE and key not in own:
            raise FieldError(where, "not a rollout setting of this engine (one of its /rollout/generate fields: "
                                    f"{', '.join(sorted(EXTRA_NATIVE))}, or the model's own fields)")
        if key in body:
            raise FieldError(where, f"given twice: in {names[key]} too")
        body[key], names[key] = value, where
    seed = body.get("seed")
    if seed is None:
        body["seed"] = seed = secrets.randbelow(2**31)  # answered in metrics: it reproduces the samples
    n = body.get("n", 1)
    return body, Plan(request_id=rid, seed=seed if isinstance(seed, int) else 0, n=n if isinstance(n, int) else 1,
                      kl=extra.get("return_kl") is True, names=names)
