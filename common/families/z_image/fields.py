"""Z-Image's request fields beyond those every family takes: ``ZImagePipeline.__call__``'s guidance settings."""

from __future__ import annotations

from dataclasses import dataclass

from common.diffusion.request_fields import FROM_MODEL, RequestField


@dataclass(frozen=True)
class RatioOrSwitch(RequestField):
    """A float field that also takes a boolean (true: 1, false: 0), as the pipeline's ``cfg_normalization``
    (typed bool, read as a float)."""

    def problem(self, value) -> str | None:
        return None if isinstance(value, bool) else super().problem(value)

    def json_schema(self) -> dict:
        schema = super().json_schema()
        schema["anyOf"].insert(1, {"type": "boolean"})
        return schema


def _ratio(value, request: dict):
    return float(value) if isinstance(value, bool) else value


CFG_NORMALIZATION = RatioOrSwitch("cfg_normalization", float, "guided prediction limited to this multiple of the "
                                 "conditional one's norm (true: 1); 0 or false: off", default=FROM_MODEL,
                                 minimum=0.0, maximum=100.0, resolve=_ratio)
CFG_TRUNCATION = RequestField("cfg_truncation", float, "guidance off at the steps whose (1000 - t) / 1000 exceeds "
                              "it (1: on at every step)", default=FROM_MODEL, minimum=0.0, maximum=1.0)
FIELDS = (CFG_NORMALIZATION, CFG_TRUNCATION)
# ZImagePipeline.__call__'s own defaults.
DEFAULTS = {"height": 1024, "width": 1024, "num_frames": 1, "num_inference_steps": 50, "guidance_scale": 5.0,
            "max_sequence_length": 512, "cfg_normalization": 0.0, "cfg_truncation": 1.0}
