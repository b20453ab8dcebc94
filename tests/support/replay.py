"""Hand-made inputs of the replay tests: a toy mini-swe trajectory (``SWE``:
``PREFIX`` then blocks ``B0``..``B3``, whose needed values are worked out in
tests/replay/test_evidence.py), step records (``rec``) and a
synthetic run of two policies on two trajectories (``RECORDS``, ``RUNS``)
whose report figures tests/replay/test_report.py works out by hand, and the
units of a resumable run (``unit``, over ``plans``)."""

from __future__ import annotations

import json

from vllm_pamer.replay.client import TrajectoryPlan
from vllm_pamer.replay.records import RunSummary, StepRecord
from vllm_pamer.replay.runs import Unit


def call(name: str, call_id: str, **arguments) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def bash(command: str, call_id: str, text: str = "") -> dict:
    return {"role": "assistant", "content": text, "tool_calls": [call("bash", call_id, command=command)]}


def tool(call_id: str, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


PREFIX = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Fix compute_total in the package."},
]
B0 = [bash('find . -name "*.py"', "s0"), tool("s0", "./pkg/alpha_module.py\n./pkg/beta_module.py")]
B1 = [bash("cat pkg/alpha_module.py", "s1"), tool("s1", "def compute_total(values):\n    return sum(values)")]
B2 = [bash("grep -n compute_total pkg/beta_module.py", "s2"), tool("s2", "no match")]
B3 = [bash("python pkg/beta_module.py", "s3"), tool("s3", "ok")]
SWE = {"id": "toy", "source": "mini-swe-agent/toy", "messages": PREFIX + B0 + B1 + B2 + B3}


def rec(
    policy,
    trajectory,
    step,
    tokens_out,
    completion=10,
    *,
    status="ok",
    tool=None,
    values=(),
    needed=0,
    available=None,
    chars=(None, 100),
):
    """A step's record: ``tokens_out`` prompt tokens sent (and used, when ok),
    the action's tool and values, needed/available evidence, (sent, original) chars."""
    return StepRecord(
        policy=policy,
        trajectory_id=trajectory,
        session_id=f"{policy}-{trajectory}",
        step=step,
        message_index=2 * step + 2,
        status=status,
        latency_s=1.0,
        prompt_tokens_in=tokens_out,
        prompt_tokens_out=tokens_out,
        usage_prompt_tokens=tokens_out if status == "ok" else None,
        usage_completion_tokens=completion if status == "ok" else None,
        action_tool=tool,
        action_values=list(values),
        needed=needed,
        available=available,
        chars_sent=chars[0],
        chars_original=chars[1],
    )


RECORDS = [
    rec("none", "A", 0, 100, tool="get_user", values=["X1234"], needed=2, available=2, chars=(100, 100)),
    rec("none", "A", 1, 200, tool=None, needed=0, available=0, chars=(200, 200)),
    rec("none", "B", 0, 300, 5, tool="search", values=["P1234", "Q1234"], needed=2, available=2, chars=(300, 300)),
    rec("none", "B", 1, 9000, status="beyond_window"),
    rec("recent_k", "A", 0, 100, tool="get_user", values=["X1234"], needed=2, available=2, chars=(100, 100)),
    rec("recent_k", "A", 1, 150, tool="cancel", values=["Y1234"], needed=0, available=0, chars=(120, 200)),
    rec("recent_k", "B", 0, 250, 5, tool="search", values=["P1234"], needed=2, available=1, chars=(200, 300)),
    rec("recent_k", "B", 1, 260, 20, tool="search", values=[], needed=4, available=1, chars=(100, 400)),
]


RUNS = [
    RunSummary(
        policy="none",
        trajectories=2,
        requests=4,
        elapsed_s=60.0,
        kv_usage_peak=0.5,
        metric_deltas={
            "vllm:prefix_cache_queries_total": 1000.0,
            "vllm:prefix_cache_hits_total": 400.0,
            "vllm:num_preemptions_total": 3.0,
        },
    ),
    RunSummary(
        policy="recent_k",
        trajectories=2,
        requests=4,
        elapsed_s=30.0,
        kv_usage_peak=0.25,
        metric_deltas={
            "vllm:prefix_cache_queries_total": 500.0,
            "vllm:prefix_cache_hits_total": 300.0,
            'vllm_pamer_internal_prompt_tokens_total{kind="summary"}': 100.0,
            'vllm_pamer_internal_completion_tokens_total{kind="summary"}': 20.0,
        },
    ),
]


def plans(kind: str, n: int) -> list[TrajectoryPlan]:
    """``n`` empty plans of trajectories ``<kind>0``, ``<kind>1``, ..."""
    return [TrajectoryPlan(f"{kind}{i}", kind, None, []) for i in range(n)]


def unit(policy: str, group: str, trajectory: str, kind: str, elapsed_s: float = 6.0) -> Unit:
    """A finished unit: one answered step of ``trajectory`` under ``policy`` in ``group``."""
    record = StepRecord(
        policy=policy,
        trajectory_id=trajectory,
        kind=kind,
        session_id=f"{policy}-{trajectory}",
        step=0,
        message_index=2,
        status="ok",
        latency_s=1.0,
        prompt_tokens_out=100,
        usage_prompt_tokens=100,
        usage_completion_tokens=10,
    )
    run = RunSummary(
        policy=policy,
        trajectories=1,
        requests=1,
        elapsed_s=elapsed_s,
        kind=kind,
        group=group,
        metric_deltas={"vllm:prefix_cache_queries_total": 100.0, "vllm:prefix_cache_hits_total": 40.0},
    )
    return Unit(run, [record])
