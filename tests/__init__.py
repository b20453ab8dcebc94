"""The tests mirror the source tree; a test module's name says what it tests.

* The tests of ``vllm_pamer/<path>/<module>.py`` are
  ``tests/<path>/test_<module>.py`` (a top-level module's are
  ``tests/test_<module>.py``); a module's tests split by aspect are
  ``test_<module>_<aspect>.py`` (``tests/worker/test_capture_engine.py``: the
  capture on a real engine). A private module and a package's
  ``__init__.py`` drop their underscores (``_rounds.py``: ``test_rounds.py``,
  ``__init__.py``: ``test_init.py``). The tests of a shared benchmark helper
  ``benchmarks/<module>.py`` are ``tests/benchmarks/test_<module>.py``.
* A test module that must run in a fresh process, under the Triton
  interpreter, is ``interp_<module>.py`` beside ``test_<module>.py``, which
  runs it (a plain ``pytest`` does not collect it; why:
  ``tests/support/kernels/fresh_process.py``).
* Tests of the product rather than one module: ``tests/e2e/`` (end to end
  against a served ``vllm-pamer serve``) and ``tests/test_layout.py`` (the
  repository's guardrails, this rule among them).
* What tests share, holding no test (fakes, strategies, builders, oracles,
  servers to start), is ``tests/support/``; benchmarks may import it, it
  imports no test module, and no test module imports another.
* Every folder is a package (``__init__.py``): equal basenames in two folders
  do not clash. Fixtures live in ``tests/conftest.py`` (and
  ``tests/e2e/conftest.py``), where every folder finds them.
* A test's cost is its marker, set once per module (``pytestmark``):
  ``engine`` (starts a vLLM engine, tens of seconds) or ``e2e`` (a served
  model); ``make test-fast`` runs everything else.

``tests/test_layout.py::test_the_tests_mirror_the_source_tree`` holds the names.
"""
