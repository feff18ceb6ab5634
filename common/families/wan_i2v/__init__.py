"""Wan image-to-video: Wan2.1 I2V (CLIP image encoder), Wan2.2 I2V-A14B (two experts) and Wan2.2 TI2V-5B."""
