"""Qwen-Image (QwenImagePipeline): the binding, its text encoder and VAE decode, and the built-in tiny models."""
