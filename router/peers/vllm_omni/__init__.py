"""vLLM-Omni's stage-aware RL HTTP API (``vllm_omni/entrypoints/openai/rl_api.py``): rollouts answered through
shared-memory handles the client opens, pause / resume, aborts, sleep / wake by stage, the weight-transfer
sequence, checksums and LoRA bodies."""
