"""Stable Diffusion 3 / 3.5."""
