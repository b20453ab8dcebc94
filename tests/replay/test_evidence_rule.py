"""The one evidence rule for every side (replay/evidence.py: ``needs``,
``readings``, the frontier's readings), on hand-made conversations with known
answers: the record's copies of the agent's own calls count as readable but
not as observed, exactly as the same calls in raw assistant messages do."""

from __future__ import annotations

import pytest

from tests.support.replay import B0, B1, B2, B3, PREFIX, SWE, bash, tool
from vllm_pamer.core.blocks import split_conversation
from vllm_pamer.core.policies.pamer.record import RECORD_HEADER, step_record, without_echoes
from vllm_pamer.replay.evidence import (
    dropped_observation_chars,
    needs,
    readings,
    recency_frontier,
    recent_k_context,
    trajectory_kind,
)
from vllm_pamer.trajectories import agent_requests, load_trajectories


def test_needs_are_observed_after_the_prefix_and_absent_from_it():
    history = PREFIX + B0 + B1
    action = bash("grep -n compute_total pkg/beta_module.py; cat pkg/gamma_module.py", "n")
    # compute_total is in the task (the prefix): no policy can lose it; gamma_module was never observed
    assert needs(history, action, "swe") == {"pkg/beta_module.py"}
    # a value only in the agent's own earlier command is no need
    assert needs(PREFIX + B1[:1] + [tool("s1", "ok")], bash("cat pkg/alpha_module.py", "u"), "swe") == set()
    # a user turn after the prefix is an observation too
    told = PREFIX + [*B0, {"role": "user", "content": "use pkg/delta_module.py"}]
    assert needs(told, bash("cat pkg/delta_module.py", "v"), "swe") == {"pkg/delta_module.py"}


def test_raw_calls_and_the_records_copies_of_them_count_alike():
    history = PREFIX + B0 + B1 + B2  # B0's output names pkg/beta_module.py; B2's command repeats it
    wanted = needs(history, B3[0], "swe")
    assert wanted == {"pkg/beta_module.py"}
    # recency keeps B2: the value is only in the agent's own command there
    assert readings(wanted, PREFIX + B2, history) == (1, 0)
    # a memory whose record copies B2's call (its result says "no match"): the same, readable only
    blocks = list(split_conversation(history).blocks)
    record = step_record(blocks[2:3], [], budget_chars=10_000)
    assert 'called bash({"command": "grep -n compute_total pkg/beta_module.py"})' in record
    memory = {"role": "user", "content": f"[memory 1] summary\n\n{record}"}
    assert readings(wanted, PREFIX + [memory], history) == (1, 0)
    # the record of B0 keeps its result excerpt, which names the value: an observation
    memory = {"role": "user", "content": f"[memory 1] summary\n\n{step_record(blocks[:1], [], 10_000)}"}
    assert readings(wanted, PREFIX + [memory], history) == (1, 1)
    # a summary that says the value is an observation too (what the summarizer kept)
    said = {"role": "user", "content": "[memory 1] beta lives in pkg/beta_module.py"}
    assert readings(wanted, PREFIX + [said], history) == (1, 1)
    # inserted copies of assistant messages (a masked history) are the agent's own: readable only
    copy = {**B2[0], "content": "again"}
    assert readings(wanted, PREFIX + [copy], history) == (1, 0)


def test_dropped_observation_chars_counts_the_observations_not_sent_as_they_are():
    history = PREFIX + B0 + B1 + B2
    outputs = len(B0[1]["content"]), len(B1[1]["content"])
    assert dropped_observation_chars(history, history) == 0
    # recency keeps B2: B0's and B1's outputs are gone (the agent's calls and the prefix are not observations lost)
    assert dropped_observation_chars(PREFIX + B2, history) == sum(outputs)
    # a masked output counts as dropped; a memory inserted in their place changes nothing
    masked = {**B1[1], "content": "[output omitted]"}
    memory = {"role": "user", "content": "[memory 1] summary"}
    assert dropped_observation_chars(PREFIX + [memory, B1[0], masked] + B2, history) == sum(outputs)


def test_without_echoes_drops_the_agents_calls_and_words_only():
    text = (
        "[memory 2] the summary names pkg/x.py\n\n" + RECORD_HEADER + "\n"
        'step 1:\n  agent: I will open pkg/y.py\n  called bash({"command": "cat pkg/y.py"})\n'
        '  result: def f(): pass\n  user: try pkg/z.py\nstep 2:\n  called bash({"command": "ls lsdir_q"})\n    more\n'
        "  result: pkg/w.py"
    )
    kept = without_echoes(text)
    assert "pkg/x.py" in kept and "def f()" in kept and "pkg/z.py" in kept and "pkg/w.py" in kept
    assert "pkg/y.py" not in kept and "lsdir_q" not in kept and "more" not in kept


@pytest.mark.parametrize("kind", ["tau", "swe"])
def test_the_frontier_reads_recency_by_the_same_rule(kind):
    """The indexed frontier's readings are ``needs`` and ``readings`` applied to
    what recent_k sends at each request."""
    trajectory = load_trajectories(kind=kind)[0]
    messages = trajectory["messages"][:60]
    short = {**trajectory, "messages": messages}
    (point,) = recency_frontier([short], ks=(2,))
    total = readable = observed = 0
    for i, history in agent_requests(messages):
        wanted = needs(history, messages[i], trajectory_kind(short))
        got = readings(wanted, recent_k_context(history, 2), history)
        total, readable, observed = total + len(wanted), readable + got.readable, observed + got.observed
    assert point.needs == total > 0
    assert point.needs_readable == pytest.approx(readable / total)
    assert point.needs_observed == pytest.approx(observed / total)
    assert point.needs_observed <= point.needs_readable


def test_the_toy_frontier_known_answer():
    # needs: step1 alpha_module (B0's output; the task names compute_total, so it is no need),
    # step2 beta_module (B0), step3 beta_module (B0)
    k1, k10 = recency_frontier([SWE], ks=(1, 10))
    assert k1.needs == 3
    assert k1.needs_observed == pytest.approx(1 / 3)  # alpha in B0 at step 1
    assert k1.needs_readable == pytest.approx(2 / 3)  # + beta in B2's own command at step 3
    assert k10.needs_readable == k10.needs_observed == 1.0


def test_a_blank_line_inside_a_call_does_not_end_its_echo():
    from vllm_pamer.core.blocks import Block

    call = {"id": "c", "type": "function", "function": {"name": "bash", "arguments": '{\n\n  "cmd": "SECRET_PATH"}'}}
    blocks = [
        Block(({"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": "done"}))
    ]
    record = step_record(blocks, [], 10_000)
    assert "SECRET_PATH" in record and "SECRET_PATH" not in without_echoes(record)
