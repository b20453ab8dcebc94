"""The case extraction of the retrieval check (``replay/retrieval.py``, which
benchmarks/retrieval.py runs): values, cases, ranking, and the captured
query's prompts; no model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vllm_pamer.replay import retrieval


def _call(call_id: str, name: str, **kwargs) -> dict:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(kwargs)}}
        ],
    }


def _tool(call_id: str, content: dict) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": json.dumps(content)}


def _tiny_trajectory() -> dict:
    """Blocks: 0 looks up the user (USR_AAA1 -> reservation RES777), 1-5 fill
    time with flight searches, 5 books FLT900; the last assistant message
    (index 13) cancels RES777, which only block 0 mentions."""
    messages = [
        {"role": "system", "content": "You are an airline agent."},
        {"role": "user", "content": "Hi, I am user USR_AAA1 and want to cancel a trip."},
        _call("c0", "get_user_details", user_id="USR_AAA1"),  # 2  block 0
        _tool("c0", {"reservations": ["RES777"], "payment": "card_5551"}),
        _call("c1", "search_flights", origin="BOS", date="2024-06-01"),  # 4  block 1
        _tool("c1", {"flights": ["FLT100"]}),
        _call("c2", "search_flights", origin="JFK", date="2024-06-02"),  # 6  block 2
        _tool("c2", {"flights": ["FLT200"]}),
        _call("c3", "search_flights", origin="SFO", date="2024-06-03"),  # 8  block 3
        _tool("c3", {"flights": ["FLT300"]}),
        _call("c4", "search_flights", origin="SEA", date="2024-06-04"),  # 10 block 4
        _tool("c4", {"flights": ["FLT400"]}),
        _call("c5", "book", flight="FLT900", payment="card_5551"),  # 12 block 5
        _tool("c5", {"ok": True}),
        _call("c6", "cancel_reservation", reservation_id="RES777"),  # 13 next message
        _tool("c6", {"ok": True}),
    ]
    # payment card_5551 and FLT900 are in R (blocks 4-5) at the last request;
    # "ab" is too short; the bool and None are not values
    gt = [
        {"name": "cancel_reservation", "kwargs": {"reservation_id": "RES777"}},
        {"name": "book", "kwargs": {"flight": "FLT900", "payment": "card_5551", "insurance": True, "x": None}},
        {"name": "note", "kwargs": {"code": "ab", "user_id": "USR_AAA1", "flights": [{"number": "FLT100"}]}},
    ]
    return {"id": "tiny", "messages": messages, "ground_truth_actions": gt}


def test_flatten_values():
    r = retrieval
    assert r.flatten_values(
        {"a": "RES777", "b": [{"c": 350, "d": 2.0, "e": 12.5}], "f": True, "g": None, "h": "ab"}
    ) == ["RES777", "350", "12.5"]


def test_case_extraction_on_a_tiny_trajectory():
    r = retrieval
    cfg = r.CheckConfig(group=3, retained=2, min_memories=1)
    check = r.check_trajectory(_tiny_trajectory(), cfg)
    # requests at assistant messages 4..14 (7 of them); at message 14 (the cancel)
    # blocks 0-5 exist: old = 0-3, and memory 0 = blocks 0-2 was archived at message 12
    assert check.requests == 7
    assert len(check.memories) == 1 and "RES777" in check.memories[0]
    last = {c.value: c for c in check.cases if c.message_index == 14}
    # in memory, not in P or R: counted
    assert last["RES777"].origin == "next" and last["RES777"].relevant == (0,)
    assert last["FLT100"].origin == "task"
    # in R (blocks 4-5): not counted; in P (the task): not counted; too short: not counted
    assert "card_5551" not in last and "FLT900" not in last
    assert "USR_AAA1" not in last and "ab" not in last
    # queries are task + R, as PaMER's recall query
    assert last["RES777"].query.startswith("user: Hi, I am user USR_AAA1")
    assert "FLT900" in last["RES777"].query and "RES777" not in last["RES777"].query
    # the deferred query's prompt: what PaMER sent at the previous request (message 12):
    # P and the blocks not archived then (3-4); memory 0 (blocks 0-2) already covered them
    messages = _tiny_trajectory()["messages"]
    assert last["RES777"].previous_request == messages[:2] + messages[8:12]
    # with the default >= 2 memories nothing is evaluated on this short trajectory
    assert r.check_trajectory(_tiny_trajectory()).cases == []


def test_ranking_and_random_baseline():
    r = retrieval
    memories = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    order = r.rank_memories(np.array([1.0, 0.1]), memories)
    assert order == [0, 2, 1, 3]  # ties to the lower id, zero vector last
    assert r.first_relevant_rank(order, [1, 3]) == 3
    hit1, hit3, mrr = r.random_expectations(n=5, r=1)
    assert (hit1, hit3) == pytest.approx((0.2, 0.6))
    assert mrr == pytest.approx(sum(1 / j for j in range(1, 6)) / 5)
    assert r.random_expectations(n=3, r=1)[1] == pytest.approx(1.0)


def test_captured_query_prompts_are_rendered_as_the_server_sends_them():
    """The deferred query of the retrieval check: one embedding per distinct
    previous request, rendered with the template (tool calls as text when the
    template has no tools); cases without a previous request are left out."""
    r = retrieval
    check = r.check_trajectory(_tiny_trajectory(), r.CheckConfig(group=3, retained=2, min_memories=1))
    cases = check.cases + [r.Case("x", 0, "v", "task", 1, (0,), "q", None)]

    class Tokenizer:
        chat_template = "{{ messages }}"  # no tool support

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert tokenize is False and add_generation_prompt is True
            return "|".join(str(m.get("content")) for m in messages)

    class Runner:
        tokenizer = Tokenizer()
        texts: list[str] = []

        def embed_batch(self, texts):
            self.texts = list(texts)
            return np.eye(len(texts), dtype=np.float32)

    runner = Runner()
    vectors = r.captured_query_vectors(runner, cases)
    assert id(cases[-1]) not in vectors and len(vectors) == len(cases) - 1
    assert len(runner.texts) == len({tuple(map(str, c.previous_request)) for c in cases[:-1]})
    last = next(c for c in cases if c.message_index == 14)
    text = runner.texts[int(np.argmax(vectors[id(last)]))]
    assert text.startswith("You are an airline agent.|Hi, I am user USR_AAA1")
    assert "<tool_call>" in text and "search_flights" in text  # calls written out as the server renders them
