"""The parts a family binding (:mod:`common.diffusion.binding`) is composed of, each written once: text,
latents, transformer, guidance, condition, decoder, experts. Each kind has a default for a family that needs
nothing special (``Guidance``: classic CFG; ``NoCondition``: text only; ``OneExpert``: one transformer)."""
