"""Prometheus metrics, exported on vLLM's own ``/metrics``."""

from prometheus_client import Counter

REQUESTS = Counter(
    "vllm_pamer_requests", "Chat requests seen by the plugin", ["policy", "action"]
)
CAPTURES = Counter("vllm_pamer_captures", "Prefill states captured and delivered")
MISSED_CAPTURES = Counter(
    "vllm_pamer_missed_captures", "Responses whose capture record did not arrive in time"
)
PROMPT_TOKENS_REMOVED = Counter(
    "vllm_pamer_prompt_tokens_removed", "Prompt tokens removed by rewrites (before minus after, when positive)"
)
TOKENS_INSERTED = Counter(
    "vllm_pamer_tokens_inserted", "Tokens of recalled memory text inserted into requests"
)


def action_label(action: str) -> str:
    """Keep label cardinality small: the action name without free text."""
    return action.split(" ", 1)[0]
