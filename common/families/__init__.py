"""Model families: one binding per diffusers pipeline."""
