"""Test support: what tests and benchmarks share to set up a run (a throw-away
PostgreSQL, tiny random models, fuzzed requests, a ``vllm-pamer serve`` to talk
to, the scaling scenarios).

The rule (pyproject.toml's import contracts hold it): benchmarks may import
``tests.support`` and nothing else of ``tests``; nothing here imports a test
module, a conftest, another test helper or a benchmark.
"""
