"""FLUX.1 (FluxPipeline): the binding, its text encoders and VAE decode, and the built-in tiny models."""
