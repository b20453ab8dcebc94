"""Evidence availability (``replay/evidence.py``) on hand-made conversations
with known answers, and the recency frontier."""

from __future__ import annotations

import pytest

from tests.support.replay import B0, B1, B2, B3, PREFIX, SWE, bash, call, tool
from vllm_pamer.replay.evidence import (
    FrontierPoint,
    availability,
    chars_share,
    command_identifiers,
    context_chars,
    evidence_messages,
    needed_values,
    recency_at,
    recency_frontier,
    recent_k_context,
)
from vllm_pamer.trajectories import agent_requests, load_trajectories

TAU_HISTORY = [
    {"role": "system", "content": "You are an airline agent."},
    {"role": "user", "content": "Hi, I am chen_lee_6825 and want to cancel a trip."},
    {"role": "assistant", "content": None, "tool_calls": [call("get_user_details", "c1", user_id="chen_lee_6825")]},
    tool("c1", '{"reservations": ["YAX4DR", "HAT136"]}'),
    {"role": "assistant", "content": "Which one? The refund would be 350.50 dollars."},
    {"role": "user", "content": "The second one."},
]


def test_tau_needed_values_come_from_observations():
    action = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            call(
                "cancel_reservation",
                "c2",
                reservation_id="HAT136",
                user_id="chen_lee_6825",
                amount="350.50",
                note="ZZZ999",
            )
        ],
    }
    # HAT136 (tool result) and the user id (user message) are evidence; 350.50 was
    # only the agent's own words; ZZZ999 appears nowhere before.
    assert needed_values(TAU_HISTORY, action, "tau") == {"HAT136", "chen_lee_6825"}


def test_command_identifiers():
    action = bash("cd /testbed && grep -n serialize_result django/contrib/admin/views/autocomplete.py | head -20", "x")
    assert command_identifiers(action) == {"serialize_result", "django/contrib/admin/views/autocomplete.py"}
    # 6+ characters; the stoplist (/testbed, /dev/null) and sed scripts s/x/y/ are not values
    action = bash("sed -i s/x/y/ ./src/main.py 2>/dev/null; python -m pytest tests.unit.test_api", "y")
    assert command_identifiers(action) == {"src/main.py", "python", "pytest", "tests.unit.test_api"}
    assert command_identifiers({"role": "assistant", "content": "thinking about compute_total"}) == set()


def test_swe_needed_values_are_read_from_tool_outputs():
    history = PREFIX + B0 + B1
    action = bash("grep -n compute_total pkg/beta_module.py; cat pkg/gamma_module.py", "n")
    # compute_total is in the task too, but also in a tool output: needed;
    # gamma_module was never observed
    assert needed_values(history, action, "swe") == {"compute_total", "pkg/beta_module.py"}
    # a value seen only in the task, or only in the agent's own command, is not
    assert needed_values(PREFIX, bash("grep compute_total -r .", "t"), "swe") == set()
    assert needed_values(PREFIX + B1[:1], bash("cat pkg/alpha_module.py", "u"), "swe") == set()


def test_availability_and_chars_share():
    messages = [{"role": "tool", "tool_call_id": "a", "content": "found HAT136 and /a/b/c.py"}]
    assert availability({"HAT136", "b/c.py", "YAX4DR", "HAT13"}, messages) == pytest.approx(0.5)
    assert availability(set(), messages) is None
    original = [{"role": "user", "content": "x" * 30}, {"role": "user", "content": "y" * 10}]
    assert chars_share(original[1:], original) == pytest.approx(0.25)
    assert context_chars(B0) == len('find . -name "*.py"') + len("./pkg/alpha_module.py\n./pkg/beta_module.py")


def test_evidence_messages_keep_observations_and_inserted_memory():
    history = PREFIX + B0 + B1 + B2
    memory = {"role": "user", "content": "Memory of earlier steps: pkg/beta_module.py has no compute_total."}
    rewritten = PREFIX + [memory] + B2
    kept = evidence_messages(rewritten, history, "swe")
    assert kept == [memory, B2[1]]  # the inserted summary and the kept tool result
    needed = needed_values(history, B3[0], "swe")
    assert needed == {"pkg/beta_module.py"}
    assert availability(needed, kept) == 1.0  # through the memory text
    assert availability(needed, evidence_messages(PREFIX + B2, history, "swe")) == 0.0  # only the agent's own command
    assert availability(needed, PREFIX + B2) == 1.0  # ... which is readable, though


def test_recent_k_context_keeps_prefix_and_last_blocks():
    history = PREFIX + B0 + B1 + B2
    assert recent_k_context(history, 1) == PREFIX + B2
    assert recent_k_context(history, 2) == PREFIX + B1 + B2
    assert recent_k_context(history, 10) == history
    assert recent_k_context(PREFIX, 2) == PREFIX


def test_recency_frontier_known_answer():
    # needed: step1 {alpha} (B0), step2 {compute_total (B1), beta (B0)}, step3 {beta (B0)}
    k1, k10 = recency_frontier([SWE], ks=(1, 10))
    assert (k1.points, k1.points_with_needs, k1.needed) == (4, 3, 4)
    assert k1.availability == pytest.approx(2 / 4)  # alpha in B0; compute_total in B1
    assert k1.readable == pytest.approx(3 / 4)  # + beta in B2's own command at step 3
    assert k10.availability == k10.readable == 1.0
    histories = [h for _, h in agent_requests(SWE["messages"])]
    sent = sum(context_chars(recent_k_context(h, 1)) for h in histories)
    assert k1.chars_share == pytest.approx(sent / sum(context_chars(h) for h in histories))
    assert k10.chars_share == 1.0


def test_recency_frontier_max_steps_counts_only_the_first_requests():
    """``max_steps`` measures the requests ``replay --max-steps`` sends: the
    same as cutting the trajectory before its (max_steps + 1)-th request."""
    first_two = recency_frontier([SWE], ks=(1,), max_steps=2)[0]
    third = [i for i, _ in agent_requests(SWE["messages"])][2]
    cut = recency_frontier([{**SWE, "messages": SWE["messages"][:third]}], ks=(1,))[0]
    assert first_two == cut
    assert first_two.points == 2 < recency_frontier([SWE], ks=(1,))[0].points


def test_recency_frontier_steps_per_trajectory():
    """A mapping gives each trajectory id its own request count; ids it does not name are skipped."""
    other = {**SWE, "id": "other"}
    (point,) = recency_frontier([SWE, other], ks=(1,), max_steps={"other": 2})
    assert point == recency_frontier([other], ks=(1,), max_steps=2)[0]
    (nothing,) = recency_frontier([SWE], ks=(1,), max_steps={})
    assert nothing.points == 0


def test_recency_at_interpolates_between_neighbouring_k():
    def point(k, chars, kept):
        return FrontierPoint(
            k=k, points=1, points_with_needs=1, needed=1, availability=kept, readable=kept, chars_share=chars
        )

    points = [point(1, 0.2, 0.3), point(2, 0.4, 0.5), point(3, 0.4, 0.5), point(4, 1.0, 1.0)]
    assert recency_at(points, 0.3) == pytest.approx(0.4)
    assert recency_at(points, 0.4) == pytest.approx(0.5)
    assert recency_at(points, 0.7) == pytest.approx(0.75)
    assert recency_at(points, 0.2) == pytest.approx(0.3)
    assert recency_at(points, 0.1) is None  # below recent_1: nothing to compare
    assert recency_at([], 0.5) is None


@pytest.mark.parametrize("kind", ["tau", "swe"])
def test_frontier_matches_the_per_step_functions(kind):
    """The indexed frontier computes what the plain functions compute."""
    trajectory = load_trajectories(kind=kind)[0]
    messages = trajectory["messages"][:60]
    short = {**trajectory, "messages": messages}
    from vllm_pamer.replay.evidence import trajectory_kind

    k = 2
    (point,) = recency_frontier([short], ks=(k,))
    needed = kept = readable = 0
    for i, history in agent_requests(messages):
        values = needed_values(history, messages[i], trajectory_kind(short))
        context = recent_k_context(history, k)
        needed += len(values)
        if values:
            kept += availability(values, evidence_messages(context, history, trajectory_kind(short))) * len(values)
            readable += availability(values, context) * len(values)
    assert point.needed == needed > 0
    assert point.availability == pytest.approx(kept / needed)
    assert point.readable == pytest.approx(readable / needed)
