"""Worker glue: what runs in vLLM's worker process (the capture of the
prefill state and the heads' vote); the runner's adapter feeds it."""
