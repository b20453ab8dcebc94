"""The verbatim record of archived steps (``core/policies/pamer/record.py``):
its budget, what it keeps first, and which blocks are most like the current work."""

from __future__ import annotations

import json

from tests.support.fakes import conversation
from vllm_pamer.core.blocks import Block, split_conversation
from vllm_pamer.core.policies.pamer.record import RECORD_HEADER, relevance, result_excerpts, step_record


def _varied(n_blocks: int, lines: int = 30) -> list[Block]:
    """Blocks whose results hold names no other result holds (``fakes.conversation``'s repeat one word)."""
    messages = conversation(n_blocks)
    for i, message in enumerate(m for m in messages if m["role"] == "tool"):
        message["content"] = "\n".join(
            f"src/mod_{i}/file_{j}.py: def handler_{i}_{j}(value_{i}_{j})" for j in range(lines)
        )
    return list(split_conversation(messages).blocks)


def test_the_record_respects_its_budget():
    blocks = _varied(6)
    current = _varied(7)[-1:]
    full = step_record(blocks, current, 1_000_000)
    for budget in (4000, 1500, 600, 200):
        record = step_record(blocks, current, budget)
        assert len(record) <= max(budget, len(RECORD_HEADER) + 40), budget
        assert record.startswith(RECORD_HEADER)
    assert len(step_record(blocks, current, 4000)) < len(full)
    assert all(f"handler_{i}_{j}" in full for i in range(6) for j in range(30))  # with room, every line


def test_a_line_that_adds_nothing_is_not_kept():
    """A result repeated word for word, and lines whose words the request holds
    anyway, cost characters and carry nothing: the record leaves them out."""
    blocks = _varied(3)
    repeat = Block((blocks[0].messages[0], {**blocks[0].messages[1]}))
    known = [{"role": "user", "content": "Task: read src/mod_2/file_0.py, def handler_2_0(value_2_0)"}]
    record = step_record([*blocks, repeat], [], 1_000_000, known=known)
    assert record.count("handler_0_5(value_0_5)") == 1
    assert "handler_2_0" not in record and "handler_2_1(value_2_1)" in record


def test_the_record_never_leaves_out_the_newest_step():
    """A step whose user turn alone is longer than the record's budget keeps
    the beginning and end of what the user said; earlier steps leave, and
    the record says so."""
    blocks = list(split_conversation(conversation(3, chars=50)).blocks)
    long_turn = {"role": "user", "content": "My booking is XK42Q9. " + "Please hurry. " * 60 + "Thanks, Omar."}
    blocks[-1] = Block((*blocks[-1].messages, long_turn))
    record = step_record(blocks, [], 400)
    assert "(steps 1-2 omitted for space)" in record and "step 3:" in record
    assert "XK42Q9" in record and "Thanks, Omar." in record
    assert len(record) <= 400 + 80


def test_a_long_call_keeps_its_ends_before_earlier_steps_leave():
    """A file written inline makes one call longer than the record: it keeps its
    beginning (the path) and end, and the earlier steps stay."""
    blocks = list(split_conversation(conversation(4, chars=50)).blocks)
    source = "def handler():\n" + "    x = compute()\n" * 400 + "    return FINAL_LINE\n"
    arguments = json.dumps({"command": f"cat <<'EOF' > src/app/handlers.py\n{source}EOF"})
    call = {"id": "w1", "type": "function", "function": {"name": "bash", "arguments": arguments}}
    write = (
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "w1", "content": "ok"},
    )
    blocks[2] = Block(write)
    record = step_record(blocks, [], 2500)
    assert "omitted for space" not in record and "step 1:" in record
    assert "src/app/handlers.py" in record and "FINAL_LINE" in record
    assert len(record) <= 2500 < len(arguments)


def test_relevance_prefers_blocks_like_the_current_work():
    blocks = list(split_conversation(conversation(3, chars=10)).blocks)
    scores = relevance(blocks, blocks[1:2])
    assert scores[1] == max(scores) and scores[1] > 0


def test_spending_counts_each_line_of_a_memory_to_what_it_carries():
    """A memory message of a summary and a record: every character is counted
    once, to the summary, the calls, the agent's words, the user, the results
    (continuation lines with their item) or the framing."""
    import numpy as np

    from vllm_pamer.core.policies.pamer.record import spending
    from vllm_pamer.core.policies.summary_writer import memory_message
    from vllm_pamer.core.store import Memory

    call = {"id": "1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
    steps = [
        Block(
            (
                {"role": "assistant", "content": "look", "tool_calls": [call]},
                {"role": "tool", "content": "a.py\nb.py"},
            )
        ),
        Block(({"role": "user", "content": "use the second\nnot the first"},)),
    ]
    record = step_record(steps, [], 10_000)
    memory = Memory(1, "s", "The goal.\n\n" + record, np.zeros(2, dtype=np.float32), "e", (), (), 0.0)
    text = str(memory_message([memory])["content"])
    spent = spending(text)
    assert sum(spent.values()) == len(text) + 1  # every line and its newline, once
    assert spent["summary"] == len("The goal.\n\n")
    assert spent["calls"] == len('  called bash({"command": "ls"})\n')
    assert spent["agent"] == len("  agent: look\n")
    assert spent["results"] == len("  result: a.py\n    b.py\n")
    assert spent["user"] == len("  user: use the second\n    not the first\n")
    assert spent["framing"] == len(text) + 1 - sum(v for k, v in spent.items() if k != "framing")
    assert spending(record)["summary"] == 0  # a record alone: nothing is summary


def _listing_step(i: int, lines: list[str]) -> Block:
    call = {"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
    return Block(
        (
            {"role": "assistant", "content": f"Step {i}: listing.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": "\n".join(lines)},
        )
    )


def test_result_excerpts_keep_the_new_lines_of_the_outputs_within_the_budget():
    """The lines kept are those that add what the request does not hold; keyed
    by the tool message they come from; none beyond the budget."""
    common = [f"src/module_{k}.py" for k in range(30)]
    blocks = [_listing_step(0, common), _listing_step(1, [*common, "ERR_4711 raised by parse_header"])]
    current = [_listing_step(2, common)]  # the live block lists the same files
    kept = result_excerpts(blocks, current, 200)
    assert set(kept) <= {(0, 1), (1, 1)}  # the tool messages, never the agent's turns
    text = "\n".join(kept.values())
    assert "ERR_4711 raised by parse_header" in text
    assert "src/module_3.py" not in text  # the live block holds it
    assert sum(len(t) for t in kept.values()) <= 200
    assert result_excerpts(blocks, current, 0) == {}


def test_result_excerpts_spend_nothing_on_a_message_that_is_not_a_tool_output():
    """Only a tool's output is masked, so only its lines have a place: a
    system note inside a block (its words rare) takes none of the room."""
    note = {"role": "system", "content": "NOTE_9911 quota_reset_at 04:00 by scheduler_main"}
    step = _listing_step(0, ["ERR_4711 raised by parse_header"])
    kept = result_excerpts([Block((*step.messages, note))], [], 400)
    assert set(kept) == {(0, 1)} and "ERR_4711" in kept[(0, 1)]
