"""vllm-pamer: server-side memory for long-horizon LLM agents, as a vLLM plugin.

Layers (each importable on its own; import contracts in ``pyproject.toml`` hold the borders):
* ``vllm_pamer.core``     - pure: chat blocks, protocol checks, rendering, the
  rewrite pipeline, policies, the engine contract, the store interface
* ``vllm_pamer.adapters`` - the only importers of vLLM internals, one package
  per vLLM version (runner hooks, model classes, serving)
* ``vllm_pamer.worker``   - worker glue: the capture, the vote, recall's memory rows
* ``vllm_pamer.server``   - API-server glue: the chat route, sessions, metrics
* ``vllm_pamer.kernels``  - Triton kernels with torch references
* ``vllm_pamer.stores``, ``vllm_pamer.training``, ``vllm_pamer.replay`` - the
  stores, probe training, trajectory replay
* ``vllm_pamer.plugin`` - the vLLM entry points; ``vllm_pamer.cli`` - the command
"""

__version__ = "0.1.0"
