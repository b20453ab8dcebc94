"""Test support: what the tests share and what benchmarks reuse to set up a
run; it holds no test. Test doubles of the engine and the store
(``fakes.py``), hypothesis strategies of agent conversations
(``chat_strategies.py``), synthetic training states (``training_fixtures.py``),
the kernels' float64 oracles and fresh-process checks (``kernels/``), a
throw-away PostgreSQL, tiny random models, fuzzed requests, a
``vllm-pamer serve`` to talk to and the scaling scenarios.

The rule (pyproject.toml's import contracts hold it): benchmarks may import
``tests.support`` and nothing else of ``tests``; support modules may import
each other, never a test module, a conftest or a benchmark.
"""
