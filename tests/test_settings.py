"""The settings object through environment variables and flags."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_pamer.settings import ENV_PREFIX, Settings


def test_round_trip_through_env():
    config = Settings(
        policy="recent_k",
        policy_options={"k": 3, "nested": {"a": [1, 2.5, None, "x"]}},
        heads="/models/heads.safetensors",
        capture=False,
        capture_wait_s=0.25,
    )
    env = config.to_env()
    assert all(key.startswith(ENV_PREFIX) and isinstance(value, str) for key, value in env.items())
    assert env["PAMER_CAPTURE"] == "0"
    assert Settings.from_env(env) == config


def test_defaults_from_an_empty_env():
    config = Settings.from_env({})
    assert config == Settings()
    assert (config.policy, config.policy_options, config.heads, config.capture) == (None, {}, None, True)
    assert config.default_policy == "none"  # no heads: nothing needs them
    assert "PAMER_HEADS" not in Settings().to_env()  # None is not written
    assert Settings.from_env(Settings().to_env()) == Settings()


def test_empty_values_mean_default():
    assert Settings.from_env({"PAMER_POLICY": "", "PAMER_HEADS": ""}) == Settings()


def test_from_env_reads_the_given_mapping_not_os_environ(monkeypatch):
    monkeypatch.setenv("PAMER_POLICY", "recent_k")
    assert Settings.from_env({}).policy is None
    assert Settings.from_env().policy == "recent_k"


@pytest.mark.parametrize(
    "raw, expected",
    [("0", False), ("false", False), ("No", False), ("OFF", False), ("1", True), ("yes", True), ("true", True)],
)
def test_capture_flag(raw, expected):
    assert Settings.from_env({"PAMER_CAPTURE": raw}).capture is expected


@pytest.mark.parametrize("raw", ["{k: 3}", "{'k': 3}", "not json", '{"k": 3'])
def test_bad_policy_options_json(raw):
    with pytest.raises(ValueError, match="PAMER_POLICY_OPTIONS"):
        Settings.from_env({"PAMER_POLICY_OPTIONS": raw})


@pytest.mark.parametrize(
    "env",
    [{"PAMER_POLICY_OPTIONS": "[1, 2]"}, {"PAMER_CAPTURE_WAIT_S": "soon"}],
    ids=["options-not-an-object", "wait-not-a-number"],
)
def test_bad_values_raise_value_error(env):
    with pytest.raises(ValueError):
        Settings.from_env(env)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@given(
    policy=st.text(min_size=1, max_size=12).filter(lambda s: "\x00" not in s),
    options=st.dictionaries(st.text(max_size=6), json_values, max_size=4),
    heads=st.none() | st.text(min_size=1, max_size=20).filter(lambda s: "\x00" not in s),
    capture=st.booleans(),
    wait=st.floats(min_value=0, max_value=1e6, allow_nan=False),
)
def test_round_trip_property(policy, options, heads, capture, wait):
    config = Settings(policy=policy, policy_options=options, heads=heads, capture=capture, capture_wait_s=wait)
    assert Settings.from_env(config.to_env()) == config


def test_default_policy_is_pamer_once_heads_exist():
    assert Settings.from_env({"PAMER_HEADS": "/x.safetensors"}).default_policy == "pamer"
    assert Settings.from_env({"PAMER_HEADS": "/x.safetensors", "PAMER_POLICY": "recent_k"}).default_policy == "recent_k"


def test_every_setting_has_a_docstring_a_variable_and_a_flag():
    import argparse

    from vllm_pamer.core.fields import field_docs

    docs = field_docs(Settings)
    assert set(docs) == set(Settings.__struct_fields__)
    parser = argparse.ArgumentParser()
    Settings.add_flags(parser)
    flags: dict[str, list[str]] = {}
    for action in parser._actions:
        flags.setdefault(action.dest, []).extend(action.option_strings)
    assert set(docs) <= set(flags)
    assert flags["capture"] == ["--pamer-capture", "--pamer-no-capture"]
    assert flags["capture_wait_s"] == ["--pamer-capture-wait-s"]
    # a switch of two words: hyphens as the README writes it, underscores as earlier versions did
    assert flags["policy_switch"] == ["--pamer-policy-switch", "--pamer-no-policy-switch", "--pamer-no-policy_switch"]
    args = parser.parse_args(["--pamer-no-session-routes", "--pamer-policy-switch"])
    assert (args.session_routes, args.policy_switch) == (False, True)
    assert parser.parse_args(["--pamer-no-session_routes"]).session_routes is False


def test_flags_override_the_environment():
    import argparse

    parser = argparse.ArgumentParser()
    Settings.add_flags(parser)
    args = parser.parse_args(
        [
            "--pamer-policy",
            "recent_k",
            "--pamer-no-capture",
            "--pamer-policy-options",
            '{"k": 4}',
            "--pamer-capture-wait-s",
            "0.5",
        ]
    )
    settings = Settings.from_env({"PAMER_POLICY": "none", "PAMER_EMBEDDER": "minilm"}).with_flags(args)
    assert (settings.policy, settings.capture, settings.policy_options) == ("recent_k", False, {"k": 4})
    assert (settings.capture_wait_s, settings.embedder) == (0.5, "minilm")  # the unflagged one from the env
    with pytest.raises(ValueError, match="--pamer-policy-options"):
        Settings().with_flags(parser.parse_args(["--pamer-policy-options", "{k: 3}"]))


def test_the_default_allow_list_is_the_servers_policy_the_cheap_baselines_and_the_named_variants():
    default = Settings(policy="pamer", options_by_policy={"recent_10": {"policy": "recent_k", "k": 10}})
    assert default.client_policies == {"pamer", "none", "recent_k", "recent_10"}
    assert Settings(allowed_policies="*").client_policies is None
    assert Settings(allowed_policies="none, sam").client_policies == {"none", "sam"}
