"""FLUX.2 [klein] (Flux2KleinPipeline): the binding, its text encoder, VAE and reference images."""
