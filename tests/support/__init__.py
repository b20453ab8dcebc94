"""Test support: what tests share and benchmarks reuse; it holds no test.

For the policy tests: a deterministic engine, head votes, conversation
builders and blocking store calls (``fakes.py``), hypothesis strategies of
agent conversations (``chat_strategies.py``), hand-made chat messages
(``messages.py``); for the store and recall tests: memories committed to a
store (``stores.py``) or made as the store returns them (``memories.py``);
for the training tests: synthetic states (``training_fixtures.py``); for the
replay tests: a toy trajectory, step records and units (``replay.py``); for
the kernel tests: float64 oracles and the fresh-process Triton checks
(``kernels/``). For the engine, end-to-end tests and the benchmarks: a
throw-away PostgreSQL (``postgres.py``), tiny random models
(``tiny_models.py``), fuzzed requests (``fuzz_requests.py``), a
``vllm-pamer serve`` to talk to (``serve.py``) and the scaling scenarios
(``scale.py``).

The rule (pyproject.toml's import contracts hold it): benchmarks may import
``tests.support`` and nothing else of ``tests``; support modules may import
each other, never a test module, a conftest or a benchmark.
"""
