"""When a VAE call runs tiled: diffusers' own spatial tiling (``enable_tiling`` / ``disable_tiling``), switched
per call by the call's size.

Tiling bounds a VAE call's activation memory by the tile size instead of the picture's, at the cost of
blended seams (diffusers' pipeline tests accept a tiled decode within 0.2 of the untiled one, frames in [0, 1])
and some overlap recomputed. The decision depends on one sample's geometry only, never on what else
shares the call, so a request's frames do not depend on its batch. The tile sizes are the VAE's own
(diffusers' defaults per class); a VAE tiles only pictures larger than its tile.
"""

from __future__ import annotations

from dataclasses import dataclass

TILING_MODES = ("auto", "on", "off")
# auto tiles above this many pixels (frames x height x width of one sample): Wan's 480p default (832 x 480, 81
# frames: 32.3M) decodes whole, 720p (1280 x 720 x 81: 74.6M) tiled; every image size up to 5792 x 5792 whole.
DEFAULT_TILING_PIXELS = 1 << 25


@dataclass(frozen=True)
class VaeTiling:
    mode: str = "auto"
    pixels: int = DEFAULT_TILING_PIXELS  # auto's budget

    def __post_init__(self) -> None:
        if self.mode not in TILING_MODES:
            raise ValueError(f"vae tiling must be one of {', '.join(TILING_MODES)}, not {self.mode!r}")
        if self.pixels < 1:
            raise ValueError(f"the vae tiling budget must be at least 1 pixel, not {self.pixels}")

    @classmethod
    def of(cls, mode: str, pixels: int | None) -> "VaeTiling":
        """From the engine's settings (``pixels`` None: the default budget)."""
        return cls(mode, DEFAULT_TILING_PIXELS if pixels is None else pixels)

    def tiled(self, frames: int, height: int, width: int) -> bool:
        """Whether a call on samples of ``frames`` x ``height`` x ``width`` pixels runs tiled."""
        if self.mode != "auto":
            return self.mode == "on"
        return frames * height * width > self.pixels

    def apply(self, vae, frames: int, height: int, width: int) -> None:
        """Set ``vae`` (a diffusers autoencoder) tiled or whole for its next call on samples of this size."""
        if self.tiled(frames, height, width):
            vae.enable_tiling()  # no arguments: the tile sizes stay what they are
        else:
            vae.disable_tiling()
