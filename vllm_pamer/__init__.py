"""vllm-pamer: server-side memory for long-horizon LLM agents, as a vLLM plugin.

Layers (each importable on its own):
* ``vllm_pamer.core``   - pure: chat blocks, protocol checks, policies, heads format
* ``vllm_pamer.engine`` - worker side: capture of the prefill state, heads
* ``vllm_pamer.server`` - API-server side: endpoint plugin, sessions, metrics
* ``vllm_pamer.plugin`` - the vLLM entry points; ``vllm_pamer.cli`` - the command
"""

__version__ = "0.1.0"
