"""Engine glue (worker side): capture, heads evaluation, vLLM adapter."""
