"""SGLang diffusion's post-training HTTP API (sglang 0.5.23's ``multimodal_gen/runtime/entrypoints/post_training/``):
``/rollout/generate`` in its body and answer, and its weight and memory routes."""
