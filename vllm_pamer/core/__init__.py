"""Pure core: no vLLM import. Chat blocks, protocol checks, policies, heads format."""
