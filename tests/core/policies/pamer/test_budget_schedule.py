"""PaMER's budget schedule (``core/policies/pamer/budget_schedule.py``) on a
real SQLite store with the deterministic engine of tests/support/fakes.py (4
characters a token): when it compacts, what it sends between compactions,
the memory it writes (summary and record), failures and restarts. The cache
hits it buys on the real server: tests/e2e/test_pamer_serve.py."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.fakes import COMPRESS, KEEP, FakeEngine, blocking, conversation
from vllm_pamer.core.blocks import protocol_issues, split_conversation
from vllm_pamer.core.pipeline import rewrite_request
from vllm_pamer.core.policies import PolicyContext, PolicyRequest, create_policy
from vllm_pamer.core.policies.pamer.budget import band_vote
from vllm_pamer.core.policies.pamer.config import BudgetConfig
from vllm_pamer.core.policies.pamer.record import RECORD_HEADER
from vllm_pamer.core.policies.summary_writer import MEMORY_HEADER
from vllm_pamer.core.store import StoreError

# conversation(n) is about 32 + 231 n tokens here; the budget below puts the band at 1,500-2,000;
# the heads' vote decides inside it (the tests of the vote; the default votes nothing: see below)
BUDGET = {"context_budget": 2000, "band_share": 0.25, "target_share": 0.5, "record_share": 0.2, "memory_share": 0.35}
BUDGET |= {"band_vote": "heads"}
# the summary inline (each request below runs in its own event loop, where a summary
# left to the background would not outlive it; the default's: test_summary_after.py)
BUDGET |= {"summary_after": False}


class Session:
    """One agent session against PaMER's budget schedule, sending the server's
    count of each request as received, as the endpoint does."""

    def __init__(self, store, services=None, **options):
        self.policy = create_policy("pamer", {**BUDGET, **options})
        self.services = services or FakeEngine(window=8192)
        self.context = PolicyContext(store, self.services)

    def send(self, messages, vote=KEEP, session="s1", **kwargs):
        tokens = self.services.count_tokens(messages)
        return asyncio.run(
            rewrite_request(
                self.policy,
                PolicyRequest(
                    messages=messages,
                    session_id=session,
                    previous_vote=vote,
                    context=self.context,
                    prompt_tokens=tokens,
                    **kwargs,
                ),
            )
        )


def test_no_compaction_below_the_band_even_on_a_compress_vote(store):
    session = Session(store)
    for n in range(1, 6):  # up to ~1,190 tokens: below the band (1,500)
        out = session.send(conversation(n), vote=COMPRESS)
        assert out.action == "none" and out.schedule.trigger is None and out.schedule.band_low == 1500
    assert blocking(store).load("s1").memories == []


def test_inside_the_band_the_vote_decides(store):
    session = Session(store)
    keep = session.send(conversation(7))  # ~1,650 tokens: inside the band
    assert keep.action == "none" and keep.schedule.trigger is None
    compress = session.send(conversation(7), vote=COMPRESS)
    assert compress.action == "compressed" and compress.schedule.trigger == "vote"
    assert compress.schedule.sent_tokens >= 1500
    assert session.services.count_tokens(compress.messages) <= compress.schedule.target  # far below the band
    assert protocol_issues(compress.messages) == [] and compress.messages[:2] == conversation(7)[:2]
    assert compress.schedule.cache_break_tokens > 0


def test_at_the_top_of_the_band_it_compacts_whatever_the_vote(store):
    out = Session(store).send(conversation(9), vote=KEEP)  # ~2,100 tokens
    assert out.action == "compressed" and out.schedule.trigger == "top_of_band"
    [event] = [e for e in blocking(store).events("s1") if e["kind"] == "compressed"]
    assert event["detail"]["trigger"] == "top_of_band" and event["detail"]["cache_break_tokens"] > 0


def test_a_request_longer_than_the_window_compacts(store):
    out = Session(store, FakeEngine(window=1200), context_budget=0).send(conversation(6), vote=None)
    assert out.action == "compressed" and out.schedule.trigger == "window"


def test_a_request_fits_the_window_only_with_room_for_its_answer(store):
    session = Session(store, FakeEngine(window=1700), context_budget=0)  # budget 1,530, band from 1,147
    assert session.send(conversation(6), session="a").action == "none"  # ~1,420 tokens, inside the band
    out = session.send(conversation(6), session="b", answer_tokens=400)  # 1,420 + 400 > 1,700
    assert out.action == "compressed" and out.schedule.trigger == "window"
    huge = session.send(conversation(2), session="c", answer_tokens=10**6)  # counted as a quarter of the window
    assert huge.action == "none"


def test_kv_pressure_compacts_earlier(store):
    roomy = Session(store, FakeEngine(window=8192, kv_usage=0.2)).send(conversation(5), session="roomy")
    scarce = Session(store, FakeEngine(window=8192, kv_usage=0.95)).send(conversation(5), session="scarce")
    assert roomy.action == "none" and roomy.schedule.budget == 2000
    assert scarce.action == "compressed" and scarce.schedule.trigger == "kv_pressure"
    assert scarce.schedule.budget == 1000 and scarce.schedule.kv_usage == 0.95


def test_under_kv_pressure_the_summary_resends_only_the_archived_steps(store):
    roomy, scarce = FakeEngine(window=8192, kv_usage=0.2), FakeEngine(window=8192, kv_usage=0.95)
    assert Session(store, roomy).send(conversation(9), session="roomy").action == "compressed"
    assert Session(store, scarce).send(conversation(5), session="scarce").action == "compressed"
    assert roomy.conversation_summaries == 1 and roomy.summaries == 1  # asked, then the text fallback
    assert scarce.conversation_summaries == 0 and scarce.summaries == 1
    asked = FakeEngine(window=8192, kv_usage=0.95)
    Session(store, asked, kv_pressure_summary_layout="conversation").send(conversation(5), session="asked")
    assert asked.conversation_summaries == 1


def test_sessions_share_the_kv_cache_while_they_are_active(store):
    import time

    engine = FakeEngine(window=8192, kv_capacity=4000)
    session = Session(store, engine, context_budget=0, kv_share=0.8, kv_share_idle_s=0.5)
    alone = session.send(conversation(2), session="a")
    assert alone.schedule.budget == 3200 and alone.schedule.kv_share == 3200  # 0.8 x 4,000, below the default 7,372
    both = session.send(conversation(2), session="b")
    assert both.schedule.budget == 1600 and both.schedule.kv_share == 1600  # two sessions share it
    time.sleep(0.6)  # a idle past kv_share_idle_s: b has the share alone again
    assert session.send(conversation(3), session="b").schedule.budget == 3200
    off = Session(store, engine, context_budget=0).send(conversation(2), session="c")
    assert off.schedule.budget == 7372 and off.schedule.kv_share is None  # kv_share is off by default


def test_a_budget_held_to_the_kv_share_summarizes_from_the_cached_conversation(store):
    engine = FakeEngine(window=8192, kv_usage=0.95, kv_capacity=1000)
    out = Session(store, engine, kv_share=0.8).send(conversation(9), vote=COMPRESS)
    assert out.action == "compressed" and out.schedule.kv_share == 800  # below the 1,000 KV usage leaves
    assert engine.conversation_summaries == 1  # not the text layout of a KV-pressure budget


def test_under_kv_pressure_a_memory_can_be_the_record_alone_at_no_engine_request(store):
    import numpy as np

    from vllm_pamer.core.recall import SERVED_STATE_EMBEDDER

    class ServedState(FakeEngine):
        embedder_name = SERVED_STATE_EMBEDDER
        embedded = 0

        async def embed(self, text):
            self.embedded += 1
            return await super().embed(text)

    engine = ServedState(window=8192, kv_usage=0.95)
    state = np.linspace(-1, 1, 64, dtype=np.float32)
    session = Session(store, engine, kv_pressure_summary=False)
    out = session.send(conversation(5), previous_state=state)
    assert out.action == "compressed" and out.schedule.trigger == "kv_pressure"
    assert engine.summaries == engine.conversation_summaries == engine.embedded == 0  # nothing asked of the engine
    [memory] = blocking(store).load("s1").memories
    assert memory.summary.startswith(RECORD_HEADER) and '"k": "ID0"' in memory.summary  # the exact call
    assert np.array_equal(memory.embedding, state)  # the captured state stands in for an embedding
    roomy = FakeEngine(window=8192, kv_usage=0.2)  # no pressure: the summary as always
    assert Session(store, roomy, kv_pressure_summary=False).send(conversation(9), session="r").action == "compressed"
    assert roomy.summaries == 1


def test_a_request_sets_its_own_budget(store):
    session = Session(store)
    assert session.send(conversation(5), context_budget=1000).schedule.trigger == "top_of_band"
    assert session.send(conversation(5), session="s2").action == "none"


def test_between_compactions_what_is_sent_only_grows_and_the_memory_text_stays(store):
    session = Session(store)
    sent = []
    for n in range(2, 20):
        out = session.send(conversation(n), vote=COMPRESS if n % 3 == 0 else KEEP)
        assert out.fallback_rule is None and protocol_issues(out.messages) == []
        sent.append((out.action, out.messages))
    compactions = [i for i, (action, _) in enumerate(sent) if action == "compressed"]
    assert len(compactions) >= 2
    for i in range(len(sent) - 1):
        if i + 1 in compactions:
            continue
        now, later = sent[i][1], sent[i + 1][1]
        assert later[: len(now)] == now, f"request {i + 1} does not extend request {i}"
    memory_messages = {str(m["content"]) for _, ms in sent[compactions[0] : compactions[1]] for m in ms[2:3]}
    assert len(memory_messages) == 1 and next(iter(memory_messages)).startswith(MEMORY_HEADER)


def test_no_token_count_between_compactions(store):
    session = Session(store)
    session.send(conversation(9))  # compacts
    counted = len(session.services.counted)
    for n in range(10, 13):
        assert session.send(conversation(n)).action == "recalled"
    assert len(session.services.counted) == counted  # the server's count less a fixed offset


def test_a_vote_inside_the_band_waits_for_a_large_step(store):
    """Right after a compaction the request may sit inside the band with
    little old history: a vote then would recompute the cache for a small gain."""
    task = {"role": "user", "content": "context " * 800}  # ~1,600 tokens of task
    messages = conversation(0) + [task] + conversation(3, chars=300)[2:]  # three small blocks after it
    out = Session(store).send(messages, vote=COMPRESS)
    assert out.schedule.sent_tokens >= out.schedule.band_low
    assert out.action == "none" and "too little old history" in out.detail


def test_the_memory_keeps_exact_values_of_the_archived_steps(store):
    messages = conversation(9)
    messages.insert(4, {"role": "user", "content": "Correction: use reservation ZQ8V1X, not the old one."})
    messages[3]["content"] = "ID0 found in src/billing/refund_rules.py"  # a name only this result holds
    out = Session(store, record_share=0.4, memory_share=0.45).send(messages)
    assert out.action == "compressed"
    [memory] = blocking(store).load("s1").memories
    text = memory.summary
    assert RECORD_HEADER in text
    assert 'called lookup({"k": "ID1"})' in text  # calls with their exact arguments
    assert "user: Correction: use reservation ZQ8V1X, not the old one." in text  # user turns verbatim
    assert "result: ID0 found in src/billing/refund_rules.py" in text.split(RECORD_HEADER, 1)[1]  # its line
    shown = out.messages[2]["content"]
    assert shown.startswith(MEMORY_HEADER) and "ZQ8V1X" in shown


def test_the_record_has_its_share_before_old_blocks_stay_raw(store):
    """With a task taking much of the target, a compaction archives raw blocks
    so that the record still gets its share of the budget."""
    task = {"role": "user", "content": "Task: fix ID-task. " + "context " * 300}  # ~600 tokens
    messages = conversation(0)[:1] + [task] + conversation(9)[2:]
    for i, message in enumerate(m for m in messages if m["role"] == "tool"):  # a name in every line: worth keeping
        message["content"] = "\n".join(f"file_{i}_{j}.py: def handler_{i}_{j}()" for j in range(25))
    out = Session(store).send(messages, vote=COMPRESS)
    assert out.action == "compressed"
    [memory] = blocking(store).load("s1").memories
    record = memory.summary.split(RECORD_HEADER, 1)[1]
    # FakeEngine counts 4 characters a token of the whole message, the record's room is
    # in the conversation's own characters of content a token: fewer here
    share = BUDGET["record_share"] * BUDGET["context_budget"] * 4
    assert 0.6 * share <= len(record) <= 1.05 * share


def test_the_newest_record_carries_the_earlier_steps_forward(store):
    """A value of an early step survives later compactions: the newest
    memory's record covers every archived step, older memories show their
    summaries only."""
    session = Session(store)
    early = conversation(9)
    early.insert(4, {"role": "user", "content": "My booking is XK42Q9."})
    assert session.send(early).action == "compressed"
    later = early + conversation(20)[2 + 2 * 9 :]  # the same session, eleven blocks on
    outs = [session.send(later[: 2 + 1 + 2 * n]) for n in range(10, 21)]
    compactions = [o for o in outs if o.action == "compressed"]
    assert compactions, [o.action for o in outs]
    memories = blocking(store).load("s1").memories
    assert len(memories) >= 2
    shown = compactions[-1].messages[2]["content"]
    assert "user: My booking is XK42Q9." in shown  # from the first compaction's steps
    assert shown.count(RECORD_HEADER) == 1  # one record: the newest memory's


def test_a_failed_summary_removes_and_stores_nothing(store):
    services = FakeEngine(window=8192, summary_error=RuntimeError("engine down"))
    messages = conversation(9)
    out = Session(store, services, summary_attempts=1).send(messages)
    assert out.action == "fallback:summary_failure" and out.messages == messages
    assert blocking(store).load("s1").memories == []


class _FailingReads:
    """The store, but the named reads raise StoreError (a lost database)."""

    def __init__(self, store, *failing):
        self.store, self.failing = store, failing

    def __getattr__(self, name):
        if name in self.failing:

            async def fail(*args, **kwargs):
                raise StoreError(f"{name} failed: the database is gone")

            return fail
        return getattr(self.store, name)


@pytest.mark.parametrize("read", ["events", "raw_blocks"])
def test_a_store_read_that_fails_during_a_compaction_is_a_storage_failure(store, read):
    """The events (what the last compaction chose) are read when a request
    shows memories this process did not choose; the archived blocks when a
    compaction writes its record. A fault in either sends the original
    request as ``storage_failure``, never as a policy error."""
    Session(store).send(conversation(9))  # one memory
    messages = conversation(10 if read == "events" else 14)
    # a new policy instance (a restart) reads the events; a compaction with a memory reads raw blocks
    session = Session(_FailingReads(store, read))
    out = session.send(messages, vote=COMPRESS)
    assert out.action == "fallback:storage_failure", out.detail
    assert out.messages == messages and "the database is gone" in out.detail
    assert len(blocking(store).load("s1").memories) == 1  # nothing stored, nothing removed
    assert blocking(store).events("s1", limit=10)[-1]["kind"] == "storage_failure"


def test_after_a_restart_the_same_memories_are_shown(store):
    first = Session(store)
    first.send(conversation(9))
    before = first.send(conversation(10))
    again = Session(store).send(conversation(10))  # a new policy instance: the server restarted
    assert before.action == again.action == "recalled"
    assert again.messages == before.messages


def test_two_processes_show_what_the_last_compaction_of_either_chose(store):
    """Two API processes (or replicas) serve one session in turns: after one
    compacts, the other shows the same memories as the one that compacted,
    not the choice it remembers from before."""
    first, second = Session(store), Session(store)
    for n in range(2, 20):
        server = first if n % 2 else second
        out = server.send(conversation(n), vote=COMPRESS if n % 3 == 0 else KEEP)
        if out.action == "compressed":
            other = second if server is first else first
            assert other.send(conversation(n)).messages == out.messages
    assert len(blocking(store).load("s1").memories) >= 2


def test_blocks_repeated_word_for_word_are_archived_each_once(store):
    """An agent (or a model's short answers, in a conversation the server
    holds) may repeat a step word for word: the compaction archives each
    copy under its own id, and the next one goes on from there."""
    step = [{"role": "assistant", "content": "I will check. " + "y" * 800}, {"role": "user", "content": "ok"}]
    messages = conversation(0) + step * 10  # the same answer and user turn, again and again, each ~230 tokens
    session = Session(store)
    out = session.send(messages, vote=KEEP)
    assert out.action == "compressed", out.detail
    [memory] = blocking(store).load("s1").memories
    assert len(set(memory.covered_block_ids)) == len(memory.covered_block_ids) > 1
    later = session.send(messages + step, vote=KEEP)
    assert later.fallback_rule is None and protocol_issues(later.messages) == []


def test_with_band_vote_never_only_the_band_top_compacts(store):
    """The vote's first ablation: inside the band nothing decides, so a
    compress vote (or none captured, with no probe failure logged) sends the
    request as it is until the band's top."""
    session = Session(store, band_vote="never")
    for vote in (COMPRESS, None):
        out = session.send(conversation(7), vote=vote)  # inside the band
        assert out.action == "none" and out.schedule.trigger is None
    assert session.send(conversation(9)).schedule.trigger == "top_of_band"
    assert "probe_missing" not in [e["kind"] for e in blocking(store).events("s1")]


def test_a_random_band_vote_is_a_seeded_coin_at_its_rate(store):
    """The second ablation: the heads' vote is ignored; a coin seeded by the
    session and its step fires at ``random_vote_rate``, the same in every
    process and run, another seed another draw."""
    config = BudgetConfig(band_vote="random", random_vote_rate=0.25)
    draws = [band_vote(config, KEEP, f"s{i}", step) for i in range(100) for step in range(20)]
    assert abs(sum(draws) / len(draws) - 0.25) < 0.03
    again = [band_vote(config, COMPRESS, f"s{i}", step) for i in range(100) for step in range(20)]
    other = BudgetConfig(band_vote="random", random_vote_rate=0.25, random_vote_seed=1)
    assert again == draws and [band_vote(other, None, f"s{i}", s) for i in range(100) for s in range(20)] != draws

    session = Session(store, band_vote="random", random_vote_rate=0.5)
    actions = [session.send(conversation(7), vote=KEEP, session=f"s{i}").action for i in range(16)]
    step = len(split_conversation(conversation(7)).blocks)
    expected = [band_vote(session.policy.config, None, f"s{i}", step) for i in range(16)]
    assert actions == ["compressed" if fired else "none" for fired in expected] and 0 < sum(expected) < 16


def _control_file(tmp_path, bias: float, context_weight: float = 0.0) -> str:
    """A control that says compress where ``bias`` + ``context_weight`` x the
    request's context_tokens / 1000 reaches 0 (its other weights 0)."""
    from vllm_pamer.core.policies.pamer.control_vote import NUMERIC

    width = 2 * len(NUMERIC)
    weights = [0.0] * width
    weights[NUMERIC.index("context_tokens") * 2 + 1] = context_weight
    path = tmp_path / f"control{bias}-{context_weight}.json"
    path.write_text(
        f'{{"tools": [], "mean": {[0.0] * width}, "scale": {[1.0] * width}, "weights": {weights}, "bias": {bias}}}'
    )
    return str(path)


def test_with_band_vote_control_the_control_decides_inside_the_band_not_the_heads(store, tmp_path):
    """The third ablation: the metadata control, read from the request, is the
    vote; the heads' vote is ignored and a missing one is no probe failure."""
    yes = Session(store, band_vote="control", control_trigger=_control_file(tmp_path, 5.0))
    no = Session(store, band_vote="control", control_trigger=_control_file(tmp_path, -5.0))
    assert yes.send(conversation(5), vote=None, session="low").action == "none"  # below the band
    assert yes.send(conversation(7), vote=None, session="a").schedule.trigger == "vote"
    assert yes.send(conversation(7), vote=KEEP, session="b").schedule.trigger == "vote"
    assert no.send(conversation(7), vote=COMPRESS, session="c").action == "none"
    assert no.send(conversation(9), vote=COMPRESS, session="d").schedule.trigger == "top_of_band"
    assert "probe_missing" not in [e["kind"] for e in blocking(store).events("a")]


def test_a_control_file_that_cannot_be_read_fails_the_policy_s_creation(tmp_path):
    with pytest.raises(FileNotFoundError):
        create_policy("pamer", {"band_vote": "control", "control_trigger": str(tmp_path / "missing.json")})
    assert create_policy("pamer", {"band_vote": "control"}) is not None  # the shipped control
    with pytest.raises(ValueError, match="only with band_vote 'control'"):
        create_policy("pamer", {"control_trigger": str(tmp_path / "control.json")})


def test_the_control_reads_the_whole_request_as_the_client_sent_it(store, tmp_path):
    """As on the points it was fitted on, where no memory covers a block: after
    a compaction the control still reads the client's whole history, not what
    the schedule sends."""
    # says compress from 2,500 tokens of history (chars // 4); the band is 1,500-2,000 tokens sent
    session = Session(store, band_vote="control", control_trigger=_control_file(tmp_path, -25.0, 10.0))
    first = session.send(conversation(9))  # ~2,145 tokens of history: the band's top compacts
    assert first.schedule.trigger == "top_of_band"
    triggers = [(n, session.send(conversation(n)).schedule) for n in range(10, 16)]
    n, second = next((n, s) for n, s in triggers if s.trigger is not None)
    assert second.trigger == "vote" and second.sent_tokens < 2000 and n >= 11  # history ~2,600+: it fires


def test_a_control_that_fails_decides_nothing_and_the_band_s_top_still_compacts(store, tmp_path, monkeypatch):
    from vllm_pamer.core.policies.pamer.control_vote import ControlTrigger

    def boom(*_args):
        raise RuntimeError("broken control")

    monkeypatch.setattr(ControlTrigger, "compress", boom)
    session = Session(store, band_vote="control", control_trigger=_control_file(tmp_path, 5.0))
    inside = session.send(conversation(7), session="a")
    assert inside.action == "none" and inside.fallback_rule is None
    assert session.send(conversation(9), session="b").schedule.trigger == "top_of_band"
    events = blocking(store).events("a")
    assert [e["detail"]["error"] for e in events if e["kind"] == "control_failed"] == ["RuntimeError('broken control')"]
    assert "probe_missing" not in [e["kind"] for e in events]  # no heads' vote was asked for


def test_by_default_nothing_votes_inside_the_band_and_its_top_compacts(store):
    """The default since the vote's ablation (RESULTS): a compress vote inside
    the band compacts nothing; the band's top does, whatever the vote."""
    options = {k: v for k, v in BUDGET.items() if k != "band_vote"}
    policy = create_policy("pamer", options)
    assert policy.config.band_vote == "never"
    session = Session(store, band_vote=policy.config.band_vote)
    assert session.send(conversation(7), vote=COMPRESS).action == "none"
    assert session.send(conversation(9), vote=KEEP).schedule.trigger == "top_of_band"


class _Overhead(FakeEngine):
    """An engine whose prompts count 50 tokens more than the count as received (a template's overhead)."""

    def prompt_tokens(self, messages, tools=None):
        return super().prompt_tokens(messages, tools) + 50


def test_near_the_window_a_request_is_counted_not_estimated(store):
    """The size estimated from the count as received can be a few tokens
    short; within ``WINDOW_SLACK`` of the window the request is counted, so
    one that would not fit compacts instead of going to vLLM to be refused."""
    whole = {"context_budget": 0, "budget_share": 1.0, "band_share": 0.0, "target_share": 0.5}
    out = Session(store, _Overhead(window=1530), **whole).send(conversation(6), answer_tokens=1)  # 1,507 as received
    assert out.action == "compressed" and out.schedule.trigger == "window"
    roomy = Session(store, _Overhead(window=1600), **whole).send(conversation(6), session="roomy", answer_tokens=1)
    assert roomy.action == "none"  # far from the window: the estimate stands


def test_the_window_guard_may_archive_the_retained_blocks_but_the_newest(store):
    """A request past the window whose live blocks are only the retained ones
    (one huge new step) archives the older of them: otherwise vLLM refuses it."""
    history = conversation(2, chars=3000)  # two blocks of ~760 tokens, both retained (R = 2)
    out = Session(store, FakeEngine(window=1200), context_budget=0).send(history, vote=None)
    assert out.action == "compressed" and out.schedule.trigger == "window", out.detail
    assert FakeEngine().count_tokens(out.messages) < 1200 and protocol_issues(out.messages) == []
