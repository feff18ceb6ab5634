"""LTX-2 (``LTX2Pipeline``, ``LTX2ImageToVideoPipeline``): video and audio latents denoised jointly."""
