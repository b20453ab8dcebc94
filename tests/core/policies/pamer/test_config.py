"""PaMER's options (``core/policies/pamer/config.py``) are checked when the policy is made."""

from __future__ import annotations

import pytest

from vllm_pamer.core.policies import create_policy


def test_settings_are_checked():
    with pytest.raises(ValueError, match="target_share"):
        create_policy("pamer", {"target_share": 0.95})  # inside the band
    with pytest.raises(ValueError, match="schedule"):
        create_policy("pamer", {"schedule": "eager"})


def test_query_source_is_checked():
    with pytest.raises(ValueError, match="query_source"):
        create_policy("pamer", {"schedule": "paper", "query_source": "state"})
