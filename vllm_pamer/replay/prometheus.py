"""Reading the server's ``/metrics`` (Prometheus text format): the counters a
replay takes deltas of, and the KV-cache gauge it samples. Pure parsing."""

from __future__ import annotations

import re
from collections.abc import Mapping

# vLLM's counters (vllm/v1/metrics/loggers.py; prometheus_client adds "_total").
VLLM_COUNTERS = (
    "vllm:prompt_tokens_total",  # every prompt token, cached or not
    "vllm:prompt_tokens_cached_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",  # requests evicted for KV space (recomputed later)
)
BY_SOURCE = "vllm:prompt_tokens_by_source_total"  # source="local_compute": prefill actually computed
KV_USAGE = "vllm:kv_cache_usage_perc"
PAMER_PREFIX = "vllm_pamer_"
INTERNAL_PROMPT = "vllm_pamer_internal_prompt_tokens_total"
INTERNAL_COMPLETION = "vllm_pamer_internal_completion_tokens_total"

_SAMPLE_RE = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_samples(text: str) -> dict[str, float]:
    """``name{labels}`` -> value for every sample line (comments skipped)."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE_RE.match(line)
        if match and not line.startswith("#"):
            try:
                samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
            except ValueError:
                continue
    return samples


def _name(sample: str) -> str:
    return sample.split("{", 1)[0]


def _labels(sample: str) -> dict[str, str]:
    return dict(_LABEL_RE.findall(sample.partition("{")[2]))


def total(samples: Mapping[str, float], name: str, **labels: str) -> float | None:
    """Sum of a metric over its label sets (vLLM labels by model and engine),
    only those with ``labels``; None when no sample matches."""
    values = [
        v
        for k, v in samples.items()
        if _name(k) == name and all(_labels(k).get(key) == value for key, value in labels.items())
    ]
    return sum(values) if values else None


def counters(samples: Mapping[str, float]) -> dict[str, float]:
    """The counters a replay tracks: vLLM's token and prefix-cache counters
    (summed over labels), and per label set vLLM's prompt tokens by source and
    every ``vllm_pamer_*_total`` sample."""
    out = {name: value for name in VLLM_COUNTERS if (value := total(samples, name)) is not None}
    out.update(
        {
            k: v
            for k, v in samples.items()
            if _name(k) == BY_SOURCE or (_name(k).startswith(PAMER_PREFIX) and _name(k).endswith("_total"))
        }
    )
    return out


def prefill_computed(delta: Mapping[str, float]) -> float | None:
    """Prompt tokens the engine computed (not served from the prefix cache):
    vLLM's ``local_compute`` source where exported, else prompt minus cached
    tokens, else prefix-cache queries minus hits."""
    computed = total(delta, BY_SOURCE, source="local_compute")
    if computed is not None:
        return computed
    prompt, cached = total(delta, "vllm:prompt_tokens_total"), total(delta, "vllm:prompt_tokens_cached_total")
    if prompt is not None and cached is not None:
        return prompt - cached
    queries, hits = total(delta, "vllm:prefix_cache_queries_total"), total(delta, "vllm:prefix_cache_hits_total")
    return queries - (hits or 0.0) if queries is not None else None


def deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """After minus before; a sample first seen after counts from zero (a
    labelled counter appears on its first increment)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def kv_usage(samples: Mapping[str, float]) -> float | None:
    """Highest KV-cache usage over engines (0-1)."""
    values = [v for k, v in samples.items() if _name(k) == KV_USAGE]
    return max(values) if values else None
