#!/usr/bin/env bash
# The GPU checks, as one run on a CUDA machine (see benchmarks/RESULTS.md):
# the kernel tests (their CUDA cases run only here), recall in the worker on the
# device (tests/worker/test_memory.py, test_memory_matrix.py) and the kernel benchmark.
# Needs torch + triton (+ pytest, tqdm, numpy); not vLLM. Writes logs to $OUT
# (or ./gpu-check-out).
set -u -o pipefail
OUT=${OUT:-gpu-check-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/machine.txt"
# the interpreter tests are CPU CI's (they run on the machine's own triton/numpy)
timeout 240 $PY -m pytest -q -p no:cacheprovider tests/kernels tests/worker/test_memory.py tests/worker/test_memory_matrix.py -rs -m "not engine" -k "${PYTEST_K:-not interpreter}" 2>&1 | tee "$OUT/pytest-kernels.log"
echo "pytest rc=$?" | tee -a "$OUT/pytest-kernels.log"
timeout 420 $PY -m benchmarks.kernels --reps 30 --sweep > "$OUT/kernels-bench.md" 2> "$OUT/kernels-bench.err"
echo "bench rc=$?"; cat "$OUT/kernels-bench.md"; tail -5 "$OUT/kernels-bench.err"
