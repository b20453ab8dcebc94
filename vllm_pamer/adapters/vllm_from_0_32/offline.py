"""vLLM's offline ``LLM`` as ``vllm_pamer.offline_engine`` drives it: build it,
prefill prompts of token ids (one greedy token each unless told otherwise),
read its window and its metrics, shut it down. Import after
``vllm_pamer.adapters.launch.prepare_vllm_cpu`` (vLLM reads the platform when
it is imported)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vllm import LLM, SamplingParams, TokensPrompt


def make_llm(**kwargs: Any) -> LLM:
    return LLM(**kwargs)


def generate_captures(
    llm: LLM, prompts: Sequence[Sequence[int]], extra_args_list: Sequence[Mapping[str, Any]], **sampling: Any
) -> None:
    """One ``generate`` call: each prompt prefilled and one token sampled
    greedily, ``extra_args_list[k]`` riding on prompt k's sampling parameters
    (the capture key the worker publishes the state under). ``sampling``:
    other ``SamplingParams`` fields, or these replaced (``max_tokens=4``)."""
    fields = {"max_tokens": 1, "temperature": 0.0, "detokenize": False, **sampling}
    params = [SamplingParams(**fields, extra_args=dict(extra)) for extra in extra_args_list]
    llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)


def max_model_len(llm: LLM) -> int:
    return int(llm.llm_engine.model_config.max_model_len)


def model_dtype(llm: LLM) -> str:
    """The dtype the engine computes in (``float32``, ``bfloat16``, ...), ``auto`` resolved."""
    return str(llm.llm_engine.model_config.dtype).removeprefix("torch.")


def kv_block_size(llm: LLM) -> int:
    """Tokens per KV-cache block: the prefix cache serves whole blocks."""
    return int(llm.llm_engine.vllm_config.cache_config.block_size)


def tokenizer(llm: LLM) -> Any:
    return llm.get_tokenizer()


def metric_total(llm: LLM, name: str) -> float:
    """The sum of the engine's metric ``name`` (a counter, e.g.
    ``vllm:num_preemptions``) over its label sets; 0 when it has none."""
    return float(sum(getattr(metric, "value", 0) for metric in llm.get_metrics() if metric.name == name))


def shutdown(llm: LLM) -> None:
    """Stop the engine's processes now, not at interpreter exit."""
    llm.llm_engine.engine_core.shutdown()
