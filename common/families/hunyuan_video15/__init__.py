"""HunyuanVideo 1.5 (``HunyuanVideo15Pipeline``, ``HunyuanVideo15ImageToVideoPipeline``)."""
