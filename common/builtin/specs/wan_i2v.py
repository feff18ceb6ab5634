"""The built-in Wan image-to-video models: :class:`TinyWanI2VSpec` (one configuration plus the request it
serves), the table of named specs, :data:`SPECS`, and their pipeline's :func:`components`. The text encoder,
tokenizer, scheduler and experts are Wan text-to-video's (:mod:`common.builtin.specs.wan`).

Three real layouts, each in tiny form (and Wan2.1 I2V once more with a compute-bound transformer,
``small-wan-i2v``):

- Wan2.1 I2V (``image_encoder``): ``WanImageToVideoPipeline`` with a CLIP vision encoder and its image
  processor; the transformer takes the CLIP states (``image_dim``) and 36 input channels (16 noise, 4 mask,
  16 encoded first frame);
- Wan2.2 I2V-A14B (``two_experts``): ``WanImageToVideoPipeline`` without an image encoder, two experts
  switching at ``boundary_ratio``, 36 input channels;
- Wan2.2 TI2V-5B (``expand_timesteps``): ``WanPipeline`` with the Wan2.2 VAE (48 latent channels, 16x
  spatial); diffusers runs its image-to-video with ``WanImageToVideoPipeline`` on the same directory.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.builtin.spec import later_field
from common.builtin.specs import wan
from common.builtin.specs.wan import TinyWanSpec

# The VAE layouts: Wan2.1's (z_dim 16, 8x spatial) and Wan2.2's (z_dim 48, residual blocks, a 2x2 pixel
# patchify in front of its 8x: 16x spatial).
VAE_LAYOUTS = ("wan2.1", "wan2.2")
VAE_Z_DIM = {"wan2.1": 16, "wan2.2": 48}
VAE_PATCH_SIZE = {"wan2.1": None, "wan2.2": 2}
# Wan's VAEs downsample 4x in time and 8x in space (before the Wan2.2 patchify).
VAE_TEMPORAL_STRIDE = 4
VAE_CONV_STRIDE = 8
# The transformer's spatial patch (WanTransformer3DModel patch_size (1, 2, 2)).
TRANSFORMER_PATCH = 2


@dataclass(frozen=True)
class TinyWanI2VSpec(TinyWanSpec):
    """One tiny Wan image-to-video configuration plus the request it is meant to serve.

    The transformer, text encoder, VAE widths, scheduler, experts and request fields are
    :class:`~common.builtin.specs.wan.TinyWanSpec`'s; these add the image conditioning.
    """

    # Wan2.2 TI2V is a WanPipeline directory (diffusers runs its image-to-video with WanImageToVideoPipeline).
    @property
    def pipeline(self) -> str:
        return "WanPipeline" if self.expand_timesteps else "WanImageToVideoPipeline"

    # Wan2.1 I2V's image encoder: CLIPVisionModel (gelu, as open-clip ViT-H/14) whose penultimate hidden
    # states the transformer cross-attends to, and CLIPImageProcessor resizing and center-cropping the
    # image to vision_image_size.
    image_encoder: bool = False
    vision_hidden_size: int = 32
    vision_layers: int = 2
    vision_heads: int = 2
    vision_intermediate_size: int = 64
    vision_image_size: int = 32
    vision_patch_size: int = 8
    # Wan2.1 FLF2V: the image embedder takes the first and the last frame's CLIP tokens together, with a
    # learned position embedding over both (pos_embed_seq_len); needs image_encoder.
    first_last_frame: bool = later_field(False)
    # Wan2.2 TI2V: WanPipeline with expand_timesteps (the first frame's latents are given, with timestep 0)
    # and the Wan2.2 VAE; the transformer then takes and predicts the VAE's latent channels only.
    expand_timesteps: bool = False
    vae_layout: str = "wan2.1"
    # The VAE decoder's base width (Wan2.2's is 256 against an encoder's 160); None: vae_base_dim.
    vae_decoder_base_dim: int | None = None

    @property
    def vae_z_dim(self) -> int:
        return VAE_Z_DIM[self.vae_layout]

    @property
    def vae_spatial_stride(self) -> int:
        return VAE_CONV_STRIDE * (VAE_PATCH_SIZE[self.vae_layout] or 1)

    @property
    def size_multiple(self) -> int:
        """Heights and widths are multiples of this: whole transformer patches of whole latent pixels."""
        return self.vae_spatial_stride * TRANSFORMER_PATCH

    @property
    def image_tokens(self) -> int:
        """The vision encoder's hidden states per image: its patches and the class token."""
        return (self.vision_image_size // self.vision_patch_size) ** 2 + 1

    @property
    def transformer_in_channels(self) -> int:
        # WanImageToVideoPipeline concatenates the noise latents, a mask with one channel per frame of a
        # VAE temporal group, and the encoded first frame; with expand_timesteps it mixes them instead.
        if self.expand_timesteps:
            return self.vae_z_dim
        return 2 * self.vae_z_dim + VAE_TEMPORAL_STRIDE

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.vae_layout not in VAE_LAYOUTS:
            raise ValueError(f"vae_layout must be one of {VAE_LAYOUTS}")
        if self.vae_decoder_base_dim is not None and self.vae_decoder_base_dim < 1:
            raise ValueError("vae_decoder_base_dim must be positive")
        if self.expand_timesteps != (self.vae_layout == "wan2.2"):
            raise ValueError("expand_timesteps goes with the Wan2.2 VAE (vae_layout 'wan2.2'), as in Wan2.2 "
                             "TI2V, and the Wan2.2 VAE with expand_timesteps")
        if self.expand_timesteps and (self.two_experts or self.image_encoder):
            raise ValueError("expand_timesteps (Wan2.2 TI2V) has one expert and no image encoder")
        if self.image_encoder and self.two_experts:
            raise ValueError("image_encoder is Wan2.1 I2V's, which has one expert (Wan2.2 I2V-A14B has none)")
        if self.height % self.size_multiple or self.width % self.size_multiple:
            raise ValueError(f"height and width must be multiples of {self.size_multiple} for this VAE")
        if self.image_encoder:
            self._check_vision()
        elif self.first_last_frame:
            raise ValueError("first_last_frame (Wan2.1 FLF2V) embeds both frames with the image encoder")
        if self.first_last_frame and self.num_frames < 2:
            raise ValueError("first_last_frame makes a video between two frames: num_frames must be at least 5")

    def _check_vision(self) -> None:
        if min(self.vision_hidden_size, self.vision_layers, self.vision_heads, self.vision_intermediate_size,
               self.vision_patch_size) < 1:
            raise ValueError("vision sizes must be positive")
        if self.vision_hidden_size % self.vision_heads:
            raise ValueError("vision_hidden_size must be a multiple of vision_heads")
        if self.vision_image_size % self.vision_patch_size:
            raise ValueError("vision_image_size must be a multiple of vision_patch_size")


SPECS: dict[str, TinyWanI2VSpec] = {
    spec.name: spec
    for spec in (
        # Like Wan2.1-I2V-14B-480P: a CLIP image encoder (32 px images in 8 px patches: 17 tokens, as the
        # real 224 / 14 give 257), one expert with 36 input channels.
        TinyWanI2VSpec(name="tiny-wan-i2v", image_encoder=True, seed=10),
        # Like Wan2.2-I2V-A14B: no image encoder, two experts switching at t = 0.9 * 1000, flow shift 5
        # and guidance 3.5 as Wan2.2's i2v_A14B config. With 4 steps the timesteps are 999/937 (high-noise
        # expert) and 833/625 (low-noise expert).
        TinyWanI2VSpec(name="tiny-wan-i2v-a14b", two_experts=True, boundary_ratio=0.9, flow_shift=5.0, seed=11,
                       guidance_scale=3.5),
        # Like Wan2.2-TI2V-5B: the Wan2.2 VAE (48 channels, 16x spatial: sizes are multiples of 32; its
        # decoder wider than its encoder, 6 against 4 as 256 against 160), expand_timesteps, flow shift 5.
        # 64x64 gives the same 2x2 patch grid per latent frame as 32x32 with the Wan2.1 VAE.
        TinyWanI2VSpec(name="tiny-wan-ti2v", expand_timesteps=True, vae_layout="wan2.2", vae_decoder_base_dim=6,
                       flow_shift=5.0, seed=12, height=64, width=64),
        # Compute-bound Wan2.1 I2V: the transformer of Wan's "small" (8 blocks, 6 heads x 64, ffn 1024, Wan's
        # freq_dim 256) plus the image cross-attention (image_dim 128, the vision width; ~19.6M parameters),
        # and a CLIP vision encoder sized by the real model's proportions: ViT-H/14's 0.63e9 parameters are
        # a few percent of the 14B transformer's, and 128 wide, 4 layers of 2 heads x 64, MLP 512 is ~0.88M
        # (4.5%). 112 px images in 14 px patches, ViT-H/14's patch: 8 x 8 + 1 = 65 tokens. Encoding an image
        # (~0.1 GFLOP, milliseconds) then shows in the encoder's timings without weighing on a request of
        # ~20 transformer forwards. The text encoder and VAE stay tiny, as "small"'s.
        TinyWanI2VSpec(name="small-wan-i2v", image_encoder=True, num_layers=8, num_attention_heads=6,
                       attention_head_dim=64, ffn_dim=1024, freq_dim=256, text_dim=64, text_layers=2,
                       text_heads=2, text_d_ff=128, text_d_kv=32, vision_hidden_size=128, vision_layers=4,
                       vision_heads=2, vision_intermediate_size=512, vision_image_size=112,
                       vision_patch_size=14, seed=13, height=128, width=128, num_frames=9,
                       num_inference_steps=10, guidance_scale=5.0),
    )
}

# The Wan2.2 VAE's latent normalisation (Wan2.2-TI2V-5B-Diffusers' vae/config.json).
WAN22_LATENTS_MEAN = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
    0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
    -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
)
WAN22_LATENTS_STD = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
)


def transformer_config(spec: TinyWanI2VSpec) -> dict:
    """``WanTransformer3DModel`` arguments for ``spec``: Wan's, with the image-to-video channels and, with an
    image encoder, its states projected into the cross-attention's added key/value (``added_kv_proj_dim``, the
    inner width, as Wan2.1 I2V)."""
    inner_dim = spec.num_attention_heads * spec.attention_head_dim
    return wan.transformer_config(spec) | dict(
        in_channels=spec.transformer_in_channels,
        out_channels=spec.vae_z_dim,
        image_dim=spec.vision_hidden_size if spec.image_encoder else None,
        added_kv_proj_dim=inner_dim if spec.image_encoder else None,
    ) | ({"pos_embed_seq_len": 2 * spec.image_tokens} if spec.first_last_frame else {})


def vae_config(spec: TinyWanI2VSpec) -> dict:
    """``AutoencoderKLWan`` arguments for ``spec``: Wan2.1's or Wan2.2's (48 latent channels, residual blocks, a
    2x2 patchify of the 3 colour channels in front: 12 in and out, 16x spatial, and its latent statistics),
    with the spec's widths."""
    config = wan.vae_config(spec)
    if spec.vae_decoder_base_dim is not None:
        config["decoder_base_dim"] = spec.vae_decoder_base_dim
    patch = VAE_PATCH_SIZE[spec.vae_layout]
    if patch is None:
        return config
    return config | dict(
        z_dim=spec.vae_z_dim,
        is_residual=True,
        in_channels=3 * patch * patch,
        out_channels=3 * patch * patch,
        patch_size=patch,
        scale_factor_temporal=VAE_TEMPORAL_STRIDE,
        scale_factor_spatial=VAE_CONV_STRIDE * patch,
        latents_mean=list(WAN22_LATENTS_MEAN),
        latents_std=list(WAN22_LATENTS_STD),
    )


def components(spec: TinyWanI2VSpec) -> dict:
    """The pipeline's components of ``spec``: Wan text-to-video's with this transformer and VAE, Wan2.2 TI2V's
    ``expand_timesteps``, and Wan2.1 I2V's CLIP vision encoder and image processor."""
    from common.builtin.image_encoders import clip_image_processor, clip_vision_encoder

    out = wan.components(spec, transformer_config(spec), vae_config(spec)) | dict(
        expand_timesteps=spec.expand_timesteps)
    if spec.image_encoder:
        out["image_encoder"] = clip_vision_encoder(
            spec, "image_encoder", hidden_size=spec.vision_hidden_size,
            intermediate_size=spec.vision_intermediate_size, num_layers=spec.vision_layers,
            num_heads=spec.vision_heads, image_size=spec.vision_image_size, patch_size=spec.vision_patch_size)
        out["image_processor"] = clip_image_processor(spec.vision_image_size)
    return out


# The parity sweep's choices (common/builtin/sweep.py): Wan's, the CLIP vision tower, the layouts of Wan2.1 and
# Wan2.2 (VAE, expanded timesteps, first and last frame), and the request.
SWEEP_KNOBS = {
    "num_layers": (1, 2), "num_attention_heads": (1, 2, 3), "attention_head_dim": (8, 12, 16),
    "ffn_dim": (16, 32), "text_dim": (16, 32), "vae_base_dim": (4, 8), "flow_shift": (1.0, 3.0, 5.0),
    "image_encoder": (True, False), "vision_hidden_size": (16, 32), "vision_layers": (1, 2),
    "first_last_frame": (False, True), "expand_timesteps": (False, True), "vae_layout": ("wan2.1", "wan2.2"),
    "two_experts": (False, True), "boundary_ratio": (None, 0.9),
    "height": (32, 48, 64), "width": (32, 64), "num_frames": (1, 5, 9), "num_inference_steps": (2, 3, 4),
    "guidance_scale": (1.0, 5.0),
}
