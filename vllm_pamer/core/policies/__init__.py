"""Memory policies behind one interface; importing this package registers them."""

from vllm_pamer.core.policies import baselines, pamer, sam, summary_baselines  # noqa: F401  (registers the policies)
from vllm_pamer.core.policies.base import (
    HeadVote,
    MemoryPolicy,
    PolicyConfig,
    PolicyContext,
    PolicyDecision,
    PolicyRequest,
    ScheduleReport,
    Trigger,
    UnknownPolicy,
    available_policies,
    create_policy,
    create_variant,
    policy_class,
    register_policy,
)

__all__ = [
    "HeadVote",
    "MemoryPolicy",
    "PolicyConfig",
    "PolicyContext",
    "PolicyDecision",
    "PolicyRequest",
    "ScheduleReport",
    "Trigger",
    "UnknownPolicy",
    "available_policies",
    "create_policy",
    "create_variant",
    "policy_class",
    "register_policy",
]
