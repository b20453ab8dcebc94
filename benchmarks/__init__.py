"""The benchmarks: each module a script (``.venv/bin/python -m benchmarks.NAME``,
figures in RESULTS.md), thin over the package (``vllm_pamer.replay`` runs the
policies). ``_*.py`` are helpers the scripts share, not scripts. A script
imports the package, those helpers and ``tests.support`` (the throw-away
PostgreSQL, tiny models, ...), never another script or a test module
(pyproject.toml's import contracts hold it)."""
