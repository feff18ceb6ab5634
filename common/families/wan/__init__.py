"""Wan text-to-video (WanPipeline), Wan2.1 and Wan2.2."""
