"""The policy interface (``core/policies/base.py``): the registry, options
checked by each policy's config, named variants, and a fallback decision
that must name a rule of the enum."""

from __future__ import annotations

import pytest

from vllm_pamer.core.fallback import Fallback
from vllm_pamer.core.policies import (
    MemoryPolicy,
    PolicyDecision,
    UnknownPolicy,
    available_policies,
    create_policy,
    policy_class,
    register_policy,
)
from vllm_pamer.core.policies.baselines import PassThrough, RecentK


def test_registry_lists_the_baselines():
    names = available_policies()
    assert "none" in names and "recent_k" in names
    assert names == sorted(names)
    assert policy_class("none") is PassThrough
    assert policy_class("recent_k") is RecentK


def test_unknown_policy_names_the_available_ones():
    with pytest.raises(UnknownPolicy) as info:
        create_policy("no_such_policy")
    message = str(info.value)
    assert "no_such_policy" in message
    for name in available_policies():
        assert name in message
    assert isinstance(info.value, ValueError)
    with pytest.raises(UnknownPolicy):
        policy_class("no_such_policy")


def test_create_policy_validates_options():
    assert create_policy("recent_k").config.k == 2
    assert create_policy("recent_k", {"k": 5}).config.k == 5
    assert isinstance(create_policy("none"), PassThrough)


@pytest.mark.parametrize(
    "name, options",
    [
        ("recent_k", {"k": 0}),
        ("recent_k", {"k": -3}),
        ("recent_k", {"k": "two"}),
        ("recent_k", {"n": 2}),
        ("recent_k", {"k": 2, "extra": True}),
        ("none", {"k": 1}),
    ],
)
def test_create_policy_rejects_bad_options(name, options):
    with pytest.raises(ValueError):
        create_policy(name, options)


def test_register_policy_refuses_a_second_class_under_a_taken_name():
    class Impostor(MemoryPolicy):
        name = "recent_k"

        async def rewrite(self, request):  # pragma: no cover - never called
            raise AssertionError

    with pytest.raises(ValueError, match="already registered"):
        register_policy(Impostor)
    assert policy_class("recent_k") is RecentK
    assert register_policy(RecentK) is RecentK  # re-registering the same class is fine


def test_variant_serves_a_policy_under_its_own_name():
    from vllm_pamer.core.policies import create_variant

    variant = create_variant("recent_10", {"policy": "recent_k", "k": 10})
    assert variant.name == "recent_10" and variant.config.k == 10
    assert create_variant("recent_k").name == "recent_k"  # plain names stay plain
    with pytest.raises(ValueError, match="hide"):
        create_variant("none", {"policy": "recent_k"})
    with pytest.raises(ValueError, match="bad options"):
        create_variant("recent_0", {"policy": "recent_k", "k": 0})


def test_a_fallback_must_name_a_rule_of_the_enum():
    assert PolicyDecision.fallback([], Fallback.STORAGE_FAILURE).action == "fallback:storage_failure"
    assert PolicyDecision.fallback([], Fallback.STORAGE_FAILURE).fallback_rule is Fallback.STORAGE_FAILURE
    with pytest.raises(ValueError, match="no_heads"):
        PolicyDecision([], "fallback:no_heads")
