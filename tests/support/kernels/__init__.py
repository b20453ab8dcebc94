"""What the kernel tests share: float64 oracles and random problems
(``oracles.py``), the NVIDIA compile check (``compile_check.py``, also a
script) and the fresh processes both Triton checks run in (``fresh_process.py``)."""
