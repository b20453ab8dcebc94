"""PaMER's paper schedule (``core/policies/pamer/paper_schedule.py``, the
paper's Algorithm 1) on a real SQLite store, with engine services replaced by
a small deterministic stand-in so that every fallback rule can be injected as
a real fault: compression, recall, the window guard, summaries written ahead,
the conversation layout, the captured query and stable recall. The real
engine path is tested end to end in tests/e2e/test_pamer_serve.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.support.fakes import COMPRESS, KEEP, FakeEngine, blocking, conversation
from vllm_pamer.core.blocks import protocol_issues, split_conversation
from vllm_pamer.core.pipeline import rewrite_request
from vllm_pamer.core.policies import PolicyContext, PolicyRequest, create_policy
from vllm_pamer.core.policies.summary_writer import MEMORY_HEADER
from vllm_pamer.core.recall import SERVED_STATE_EMBEDDER, WorkerRecall
from vllm_pamer.core.store import StepDetail


def asked(messages, vote, context, session="s1", **fields):
    """The pipeline's request of ``session`` (its previous vote ``vote``)."""
    return PolicyRequest(messages=messages, session_id=session, previous_vote=vote, context=context, **fields)


def run(messages, store, services, vote, session="s1", **options):
    """PaMER on the paper's schedule (the budget schedule: test_budget_schedule.py)."""
    policy = create_policy("pamer", {"schedule": "paper", **options})
    return asyncio.run(
        rewrite_request(
            policy,
            asked(messages, vote, PolicyContext(store, services), session=session),
        )
    )


def test_compression_commits_then_sends_prefix_and_recent(store):
    messages = conversation(8)
    outcome = run(messages, store, FakeEngine(), COMPRESS)
    assert outcome.action == "compressed"
    blocks = split_conversation(messages).blocks
    assert outcome.messages == messages[:2] + list(blocks[-2].messages) + list(blocks[-1].messages)
    [memory] = blocking(store).load("s1").memories
    assert set(memory.covered_block_ids) == {b.block_id for b in blocks[:-2]}
    assert "ID0" in memory.summary and "ID5" in memory.summary
    raw = blocking(store).raw_blocks("s1", list(memory.covered_block_ids))
    assert [raw[b.block_id] for b in blocks[:-2]] == [list(b.messages) for b in blocks[:-2]]
    assert [e["kind"] for e in blocking(store).events("s1")] == ["compression_started", "compressed"]


def test_later_request_drops_covered_blocks_and_recalls_after_prefix(store):
    messages = conversation(8)
    run(messages, store, FakeEngine(), COMPRESS)
    later = conversation(10)  # the agent resends everything plus two new blocks
    outcome = run(later, store, FakeEngine(), KEEP)
    assert outcome.action == "recalled"
    assert outcome.recalled == (blocking(store).load("s1").memories[0].id,)  # reported for clients
    assert outcome.messages[:2] == later[:2]
    assert outcome.messages[2]["content"].startswith(MEMORY_HEADER)
    # covered blocks are gone; the two formerly recent blocks and the new ones stay raw
    assert outcome.messages[3:] == later[2 + 2 * 6 :]
    assert protocol_issues(outcome.messages) == []
    # a repeat gives the very same request (stable for the prefix cache)
    assert run(later, store, FakeEngine(), KEEP).messages == outcome.messages


def test_below_gate_never_compresses(store):
    outcome = run(conversation(8, chars=40), store, FakeEngine(), COMPRESS)
    assert outcome.action == "none" and blocking(store).load("s1").memories == []


def test_missing_vote_skips_compression_but_recall_still_works(store):
    run(conversation(8), store, FakeEngine(), COMPRESS)
    outcome = run(conversation(20), store, FakeEngine(), None)
    assert outcome.action == "recalled"
    assert "compression skipped" in outcome.detail
    assert len(blocking(store).load("s1").memories) == 1


@pytest.mark.parametrize("vote", [None, KEEP])
def test_window_guard_compresses_a_request_the_window_cannot_hold(store, vote):
    """No vote can come from a request the engine refuses (it is never
    prefilled), so without the guard the session would stay refused."""
    messages = conversation(8)  # about 2,000 tokens at 4 characters a token
    outcome = run(messages, store, FakeEngine(window=1_800), vote)
    assert outcome.action == "compressed" and "longer than the window" in outcome.detail
    assert len(blocking(store).load("s1").memories) == 1
    assert "window_guard" in [e["kind"] for e in blocking(store).events("s1")]


def test_window_guard_counts_the_tools_and_can_be_turned_off(store):
    messages, tools = conversation(8), [{"type": "function", "function": {"name": f"t{i}"}} for i in range(4)]
    policy = create_policy("pamer", {"schedule": "paper"})
    fits = asyncio.run(
        rewrite_request(
            policy,
            asked(messages, KEEP, PolicyContext(store, FakeEngine(window=2_100))),
        )
    )
    assert fits.action == "none"  # fits without the tools
    with_tools = asyncio.run(
        rewrite_request(
            policy,
            asked(messages, KEEP, PolicyContext(store, FakeEngine(window=2_100)), tools=tools),
        )
    )
    assert with_tools.action == "compressed"  # 200 tool tokens push it past the window
    off = run(conversation(8), store, FakeEngine(window=1_800), None, session="s2", window_guard=False)
    assert off.action == "none" and "compression skipped" in off.detail and blocking(store).load("s2").memories == []


class CountingWindowServices(FakeEngine):
    def __init__(self, window, **kwargs):
        super().__init__(window=window, **kwargs)
        self.whole_counts = 0

    def prompt_tokens(self, messages, tools=None):
        self.whole_counts += 1
        return super().prompt_tokens(messages, tools)


def test_window_guard_trusts_the_servers_count_below_the_window(store):
    """The server counts the request as received off its event loop; the
    messages the guard checks are a subset, so a count below the window needs
    no second whole-history count."""
    messages = conversation(8)
    policy = create_policy("pamer", {"schedule": "paper"})
    services = CountingWindowServices(2_100)
    below = asyncio.run(
        rewrite_request(
            policy,
            asked(messages, KEEP, PolicyContext(store, services), prompt_tokens=2_099),
        )
    )
    assert below.action == "none" and services.whole_counts == 0
    # at the window the guard counts what would go out itself: it fits (no
    # memory covers a block yet, so that is the request, about 2,000 tokens)
    at = asyncio.run(
        rewrite_request(
            policy,
            asked(messages, KEEP, PolicyContext(store, services), prompt_tokens=2_100),
        )
    )
    assert at.action == "none" and services.whole_counts == 1
    over = asyncio.run(
        rewrite_request(
            policy,
            asked(messages, KEEP, PolicyContext(store, CountingWindowServices(1_800)), prompt_tokens=2_100),
        )
    )
    assert over.action == "compressed"


def test_window_guard_failure_still_removes_nothing(store):
    messages = conversation(8)
    outcome = run(
        messages, store, FakeEngine(window=1_800, summary_error=RuntimeError("engine error")), None, summary_attempts=1
    )
    assert outcome.action == "fallback:summary_failure" and outcome.messages == messages
    assert blocking(store).load("s1").memories == []


@pytest.mark.parametrize(
    "services, rule",
    [
        (FakeEngine(summary_error=RuntimeError("engine error")), "summary_failure"),
        (FakeEngine(summary_delay=1.0), "summary_failure"),  # timeout on every attempt
        (FakeEngine(embed_error=ConnectionError("embedder down")), "embedding_failure"),
    ],
)
def test_engine_failures_commit_nothing_and_remove_nothing(store, services, rule):
    messages = conversation(8)
    outcome = run(messages, store, services, COMPRESS, summary_timeout_s=0.05, summary_attempts=2, embed_attempts=2)
    assert outcome.action == f"fallback:{rule}"
    assert outcome.messages == messages
    assert blocking(store).load("s1").memories == []


def test_recall_failure_sends_the_original_request(store):
    run(conversation(8), store, FakeEngine(), COMPRESS)
    later = conversation(10)
    outcome = run(later, store, FakeEngine(embed_error=TimeoutError("slow")), KEEP, embed_attempts=1)
    assert outcome.action == "fallback:recall_failure"
    assert outcome.messages == later


def test_sessions_are_isolated(store):
    run(conversation(8), store, FakeEngine(), COMPRESS, session="a")
    assert blocking(store).load("b").memories == []
    outcome = run(conversation(10), store, FakeEngine(), KEEP, session="b")
    assert outcome.action == "none" and outcome.messages == conversation(10)


class FlakyServices(FakeEngine):
    """Fails the first summary, then works."""

    async def summarize(self, source, max_tokens):
        if self.summaries == 0 and not getattr(self, "failed", False):
            self.failed = True
            raise RuntimeError("first summary fails")
        return await super().summarize(source, max_tokens)


@pytest.mark.parametrize("new_blocks", [1, 2])
def test_summary_written_ahead_is_committed_by_the_next_request(store, new_blocks):
    services = FakeEngine()

    async def scenario():
        policy = create_policy("pamer", {"schedule": "paper", "summarize_ahead": True})
        context = PolicyContext(store, services)
        t = conversation(7)
        first = await rewrite_request(policy, asked(t, KEEP, context))
        assert first.action == "none"
        await policy.on_vote("s1", COMPRESS, context)  # request t's vote, at its prefill
        for _ in range(500):  # the summary runs in the background: wait for it, up to 5 s
            if services.summaries:
                break
            await asyncio.sleep(0.01)
        assert services.summaries == 1  # written before request t+1 exists
        later = conversation(7 + new_blocks)
        return await rewrite_request(policy, asked(later, COMPRESS, context)), later

    outcome, later = asyncio.run(scenario())
    assert outcome.action == "compressed" and "summary written ahead" in outcome.detail
    assert services.summaries == 1  # no second summary inside request t+1
    blocks = split_conversation(later).blocks
    [memory] = blocking(store).load("s1").memories
    # the early summary covers the blocks that were old-to-be at t: all but the last of t's blocks
    assert list(memory.covered_block_ids) == [b.block_id for b in blocks[:6]]
    kept = [m for b in blocks[6:] for m in b.messages]
    assert outcome.messages == later[:2] + kept
    assert protocol_issues(outcome.messages) == []


def test_failed_ahead_summary_falls_back_to_the_synchronous_path(store):
    services = FlakyServices()

    async def scenario():
        policy = create_policy("pamer", {"schedule": "paper", "summarize_ahead": True, "summary_attempts": 1})
        context = PolicyContext(store, services)
        await rewrite_request(policy, asked(conversation(7), KEEP, context))
        await policy.on_vote("s1", COMPRESS, context)
        return await rewrite_request(policy, asked(conversation(8), COMPRESS, context))

    outcome = asyncio.run(scenario())
    assert outcome.action == "compressed" and "ahead" not in outcome.detail
    assert "summary_ahead_failed" in [e["kind"] for e in blocking(store).events("s1")]


def test_keep_vote_starts_nothing_ahead(store):
    services = FakeEngine()

    async def scenario():
        policy = create_policy("pamer", {"schedule": "paper", "summarize_ahead": True})
        context = PolicyContext(store, services)
        await rewrite_request(policy, asked(conversation(7), KEEP, context))
        await policy.on_vote("s1", KEEP, context)
        await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert services.summaries == 0


def test_no_summary_ahead_for_blocks_just_archived(store):
    """After request t compressed, the next-old candidate is what stays live,
    not the blocks that were just archived."""
    services = FakeEngine()

    async def scenario():
        policy = create_policy("pamer", {"schedule": "paper", "summarize_ahead": True})
        context = PolicyContext(store, services)
        outcome = await rewrite_request(policy, asked(conversation(8), COMPRESS, context))
        assert outcome.action == "compressed"
        await policy.on_vote("s1", COMPRESS, context)
        await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert services.summaries == 1  # the synchronous one only


def test_recall_searches_only_memories_of_the_current_embedder(store):
    run(conversation(8), store, FakeEngine(), COMPRESS)

    class OtherEmbedder(FakeEngine):
        embedder_name = "other"

        async def embed(self, text):
            return np.ones(384, dtype=np.float32)  # another dimension: not comparable

    outcome = run(conversation(10), store, OtherEmbedder(), KEEP)
    assert outcome.action == "recalled"  # not a recall failure
    assert MEMORY_HEADER not in str(outcome.messages)
    assert protocol_issues(outcome.messages) == []


class ConversationServices(FakeEngine):
    """Services that also summarize chat messages as they are (the
    conversation layout), recording what they were given."""

    def __init__(self, fits=True, **kwargs):
        super().__init__(**kwargs)
        self.fits, self.conversations = fits, []

    async def summarize_conversation(self, messages, max_tokens):
        self.conversations.append(list(messages))
        if not self.fits:
            return None
        return "CONVERSATION SUMMARY " + " ".join(
            sorted({w for m in messages for w in str(m.get("content") or "").split() if w.startswith("ID")})
        )


def test_conversation_layout_resends_what_the_engine_saw_then_asks(store):
    """summary_layout="conversation": the summary request is the previous
    request cut after the old steps (P, the memories it showed, O) plus an
    instruction turn, so its prefix is in vLLM's prefix cache."""
    services = ConversationServices()

    async def scenario():
        policy = create_policy("pamer", {"schedule": "paper", "summary_layout": "conversation"})
        context = PolicyContext(store, services)
        first = await rewrite_request(policy, asked(conversation(8), COMPRESS, context))
        shown = await rewrite_request(policy, asked(conversation(10), KEEP, context))  # shows memory 1
        second = await rewrite_request(policy, asked(conversation(16), COMPRESS, context))
        return first, shown, second

    first, shown, second = asyncio.run(scenario())
    assert (first.action, shown.action, second.action) == ("compressed", "recalled", "compressed")
    assert services.summaries == 0  # the text layout was never needed
    one, two = services.conversations
    blocks = split_conversation(conversation(8)).blocks
    assert one[:-1] == conversation(8)[:2] + [m for b in blocks[:-2] for m in b.messages]
    assert one[-1]["role"] == "user" and "Write only the summary" in one[-1]["content"]
    assert "memory list" not in one[-1]["content"]
    # the second summary starts like the request before it: P, the memory message, then the live blocks
    assert two[: len(shown.messages) - 4] == shown.messages[:-4]
    assert two[2]["content"].startswith(MEMORY_HEADER) and "memory list" in two[-1]["content"]
    memories = blocking(store).load("s1").memories
    assert [m.summary.split()[:2] for m in memories] == [["CONVERSATION", "SUMMARY"]] * 2
    assert "ID0" in memories[0].summary and "ID5" in memories[0].summary


def test_conversation_layout_falls_back_to_text(store):
    services = ConversationServices(fits=False)  # the conversation does not fit the window
    outcome = run(conversation(8), store, services, COMPRESS, summary_layout="conversation")
    assert outcome.action == "compressed" and services.summaries == 1 and len(services.conversations) == 1
    assert blocking(store).load("s1").memories[0].summary.startswith("SUMMARY")
    # the paper's text layout (PaMER+'s default) never sends the conversation
    services = ConversationServices()
    run(conversation(8), store, services, COMPRESS, session="s2", summary_layout="text")
    assert services.conversations == [] and services.summaries == 1
    with pytest.raises(ValueError, match="summary_layout"):
        create_policy("pamer", {"schedule": "paper", "summary_layout": "chat"})


class StateServices(FakeEngine):
    """Memories embedded as the served model's state (the captured query's space)."""

    embedder_name = SERVED_STATE_EMBEDDER

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embedded: list[str] = []

    async def embed(self, text):
        self.embedded.append(text)
        return await super().embed(text)


def test_captured_query_recalls_without_an_embedding_request(store):
    """``query_source="captured"``: the state captured at the previous request
    is the query; no internal embedding request runs for it, and the memory
    closest to that state comes back."""
    services = StateServices()
    run(conversation(8), store, services, COMPRESS)
    run(conversation(14), store, services, COMPRESS)  # a second memory
    memories = blocking(store).load("s1").memories
    assert len(memories) == 2
    services.embedded.clear()
    later = conversation(16)
    for target in memories:
        state = np.asarray(target.embedding, dtype=np.float32)
        outcome = asyncio.run(
            rewrite_request(
                create_policy(
                    "pamer", {"schedule": "paper", "query_source": "captured", "top_k": 1, "stable_recall": False}
                ),
                asked(later, KEEP, PolicyContext(store, services), previous_state=state),
            )
        )
        assert outcome.action == "recalled" and outcome.recalled == (target.id,)
        assert "state captured at the previous request" in outcome.detail
    assert services.embedded == []  # no query embedding was computed


def test_the_workers_search_decides_and_the_memories_are_handed_to_it(store):
    """With the worker's Top-K made at the previous capture, the policy takes
    its ranking (here one that disagrees with the state, to see whose it is)
    and hands the session's memories to the worker for the next capture."""
    services = StateServices()
    run(conversation(8), store, services, COMPRESS)
    run(conversation(14), store, services, COMPRESS)
    first, second = blocking(store).load("s1").memories
    state = np.asarray(first.embedding, dtype=np.float32)  # closest to the first memory
    worker = WorkerRecall(ids=(second.id, first.id), scores=(0.9, 0.1), searched=(first.id, second.id), limit=8)
    policy = create_policy(
        "pamer", {"schedule": "paper", "query_source": "captured", "top_k": 1, "stable_recall": False}
    )

    def recall_with(found):
        context = PolicyContext(store, services)
        return asyncio.run(
            rewrite_request(
                policy,
                asked(conversation(16), KEEP, context, previous_state=state, previous_recall=found),
            )
        )

    outcome = recall_with(worker)
    assert outcome.recalled == (second.id,) and "searched in the worker" in outcome.detail
    assert services.synced["s1"] == [first.id, second.id]
    # a memory the worker did not hold is scored here: it wins on the state
    outcome = recall_with(WorkerRecall(ids=(second.id,), scores=(0.1,), searched=(second.id,), limit=8))
    assert outcome.recalled == (first.id,)


@pytest.mark.parametrize("case", ["no state", "other embedder", "other width"])
def test_captured_query_falls_back_to_the_text_query(store, case):
    services = StateServices()
    run(conversation(8), store, services, COMPRESS)
    services.embedded.clear()
    state = np.ones(64, dtype=np.float32)
    if case == "no state":
        state = None
    elif case == "other embedder":
        services.embedder_name = "bag-of-words"  # memories were embedded as the served state
    else:
        state = np.ones(32, dtype=np.float32)
    policy = create_policy("pamer", {"schedule": "paper", "query_source": "captured"})
    outcome = asyncio.run(
        rewrite_request(
            policy,
            asked(conversation(10), KEEP, PolicyContext(store, services), previous_state=state),
        )
    )
    if case == "other embedder":  # nothing searchable under another embedder: no recall at all
        assert outcome.action in ("recalled", "none") and "captured" not in outcome.detail
    else:
        assert outcome.action == "recalled" and "captured" not in outcome.detail
        assert len(services.embedded) == 1  # the text query, as without the option


def test_text_query_source_embeds_task_and_recent_even_with_a_state(store):
    """The paper's query (``query_source="text"``); the default is the captured state."""
    assert create_policy("pamer").config.query_source == "captured"
    services = StateServices()
    run(conversation(8), store, services, COMPRESS)
    services.embedded.clear()
    outcome = asyncio.run(
        rewrite_request(
            create_policy("pamer", {"schedule": "paper", "query_source": "text"}),
            asked(conversation(10), KEEP, PolicyContext(store, services), previous_state=np.ones(64, dtype=np.float32)),
        )
    )
    assert outcome.action == "recalled" and "captured" not in outcome.detail
    assert len(services.embedded) == 1 and services.embedded[0].startswith("user: Task: fix ID-task")


def test_pamer_recall_text_stays_identical_while_the_query_drifts(store):
    """Four memories, Top-2: plain Top-K flips between requests whose queries
    differ slightly, stable recall sends the same text."""
    services = FakeEngine()
    archived = split_conversation(conversation(7)).blocks[3:]  # not in the requests below
    for i, block in enumerate(archived):
        vector = np.eye(64, dtype=np.float32)[i] + 0.5
        detail = StepDetail(step=0, block_id=block.block_id, tool_names=("lookup",), chars=100)
        blocking(store).commit_memory("s", f"memory about topic {i}", vector, services.embedder_name, [block], [detail])
    queries = [np.eye(64)[0] * 1.0 + np.eye(64)[1] * 0.98, np.eye(64)[0] * 0.98 + np.eye(64)[1] + np.eye(64)[2] * 1.01]

    def recalled(policy):
        texts, ids = [], []
        for q in queries:
            services.embed = lambda text, q=q: asyncio.sleep(0, result=q.astype(np.float32))
            out = asyncio.run(
                rewrite_request(
                    policy,
                    asked(conversation(3), KEEP, PolicyContext(store, services), session="s"),
                )
            )
            texts.append(out.messages[2]["content"])
            ids.append(out.recalled)
        return texts, ids

    plain, plain_ids = recalled(create_policy("pamer", {"schedule": "paper", "top_k": 2, "stable_recall": False}))
    stable, stable_ids = recalled(create_policy("pamer", {"schedule": "paper", "top_k": 2}))
    assert plain[0] != plain[1] and plain_ids[0] != plain_ids[1]
    assert stable[0] == stable[1] == plain[0]
    assert stable_ids[0] == stable_ids[1] == plain_ids[0]


def test_a_compression_whose_client_went_away_still_ends_with_an_event(store):
    """A compression cancelled while its summary is written (the route cancels
    the handler of a client that disconnected) logs its end."""
    policy = create_policy("pamer", {"schedule": "paper"})

    async def scenario():
        context = PolicyContext(store, FakeEngine(summary_delay=5.0))
        request = asyncio.ensure_future(rewrite_request(policy, asked(conversation(8), COMPRESS, context)))
        await asyncio.sleep(0.3)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        return await store.events("s1")

    events = asyncio.run(scenario())
    assert [e["kind"] for e in events] == ["compression_started", "compression_abandoned"]
    assert events[-1]["detail"] == {"reason": "cancelled"}
