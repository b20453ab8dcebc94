"""The only modules that import vLLM: one package per supported vLLM series."""
