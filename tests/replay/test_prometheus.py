"""Reading vLLM's ``/metrics`` (``replay/prometheus.py``): counters summed over
engines, deltas, and the prefill a run computed."""

from __future__ import annotations

from vllm_pamer.replay import prometheus

METRICS = """\
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1500.0
vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e9
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1200.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 200.0
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
vllm:num_preemptions_total{engine="1",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.125
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm_pamer_internal_prompt_tokens_total{kind="summary"} 40.0
vllm_pamer_requests_total{action="none",policy="none"} 3.0
"""


def test_prometheus_counters_and_deltas():
    samples = prometheus.parse_samples(METRICS)
    assert prometheus.kv_usage(samples) == 0.25
    before = prometheus.counters(samples)
    assert before["vllm:prompt_tokens_total"] == 1500 and "vllm:generation_tokens_total" not in before
    assert before["vllm:num_preemptions_total"] == 3  # summed over engines
    after_text = METRICS.replace("1500.0", "1600.0") + 'vllm_pamer_internal_prompt_tokens_total{kind="embedding"} 3.0\n'
    delta = prometheus.deltas(before, prometheus.counters(prometheus.parse_samples(after_text)))
    assert delta["vllm:prompt_tokens_total"] == 100
    assert prometheus.total(delta, prometheus.INTERNAL_PROMPT) == 3  # a label set that appeared counts from 0
    assert prometheus.total(delta, "vllm:prefix_cache_hits_total") == 0
    assert prometheus.parse_samples("") == {} and prometheus.kv_usage({}) is None


def test_prefill_computed_prefers_vllms_own_breakdown():
    by_source = """vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 700.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 300.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 1000.0
vllm:prompt_tokens_cached_total{engine="0",model_name="m"} 250.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 900.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 100.0
"""
    delta = prometheus.deltas({}, prometheus.counters(prometheus.parse_samples(by_source)))
    assert prometheus.prefill_computed(delta) == 700
    without_source = {k: v for k, v in delta.items() if "by_source" not in k}
    assert prometheus.prefill_computed(without_source) == 750  # prompt - cached
    assert prometheus.prefill_computed({"vllm:prefix_cache_queries_total": 900.0}) == 900
    assert prometheus.prefill_computed({}) is None
