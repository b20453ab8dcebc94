"""``vllm-pamer extract`` on a real vLLM engine (tiny random Llama): the states
of the full context and of Recent2 (P + R_t) for real decision points equal
HF transformers' final-norm last-token states of the same token ids; cut
prompts keep their first tokens and the most recent rest; a second run resumes
(no work, same data); the metadata carries the annotation's labels."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest
import torch

from tests.support.tiny_models import build_tiny_model, hf_last_token_states
from vllm_pamer.core.render import render_tools_as_text
from vllm_pamer.offline_engine import CaptureEngine
from vllm_pamer.training.annotate import annotate_trajectory, char_counter
from vllm_pamer.training.data import (
    StatesError,
    load_data,
    load_labels,
    load_layer_states,
    load_states,
    shard_dtype,
    write_shard,
)
from vllm_pamer.training.extract import ExtractError, extract, join_points, run_manifest, select_points
from vllm_pamer.training.prompts import ChatPrompter, token_limit
from vllm_pamer.trajectories import load_trajectories

pytestmark = pytest.mark.engine

MAX_MODEL_LEN = 2048  # the tiny model's window: early points fit, later ones are cut
STEPS = 6  # first decision points of each trajectory
SHARD = 5  # 12 points -> shards of 5, 5, 2


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("extract-engine")
    model_dir = build_tiny_model("llama", root / "model", tokenizer_dir)
    live = CaptureEngine(
        model_dir, max_model_len=MAX_MODEL_LEN, dtype="float32", gpu_memory_utilization=0.15, max_num_seqs=16
    )
    try:
        yield live, model_dir
    finally:
        live.close()  # shut the engine down now, not at interpreter exit


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    """Two shipped trajectories (one tau, one swe) and the labels of their
    first decision points, as files."""
    root = tmp_path_factory.mktemp("extract-data")
    trajectories = [load_trajectories(None, "tau")[0], load_trajectories(None, "swe")[0]]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(t) + "\n" for t in trajectories))
    points = [p for t in trajectories for p in annotate_trajectory(t, char_counter) if p.step < STEPS]
    labels = root / "labels.jsonl"
    labels.write_bytes(b"".join(msgspec.json.encode(p) + b"\n" for p in points))
    return data, labels, trajectories, points


def _prompter(model_dir, keep_head):
    from transformers import AutoTokenizer

    return ChatPrompter(AutoTokenizer.from_pretrained(model_dir), token_limit(MAX_MODEL_LEN), keep_head)


def _expected_ids(tokenizer, messages, keep_head):
    """What the engine must see, computed independently of the extractor."""
    ids = tokenizer.apply_chat_template(render_tools_as_text(messages), tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    limit = MAX_MODEL_LEN - 1
    if len(ids) <= limit:
        return ids, len(ids), False
    head = min(keep_head, limit // 2)  # 2048 is scaled down to the small window
    step = (limit - head) // 2  # the cut moves in halves of the recent room (CUT_STRIDE)
    dropped = -(-(len(ids) - limit) // step) * step
    return ids[:head] + ids[head + dropped :], len(ids), True


def _cosines(states: np.ndarray, reference: torch.Tensor) -> np.ndarray:
    ours = torch.from_numpy(states)
    return torch.nn.functional.cosine_similarity(ours, reference, dim=1).numpy()


@pytest.mark.parametrize("keep_head", [64, 2048])
def test_states_match_hf_with_truncation(engine, labelled, tmp_path, keep_head):
    live, model_dir = engine
    data, labels, trajectories, annotated = labelled
    prompter = _prompter(model_dir, keep_head)
    points = join_points(load_labels(labels), load_data([data]))
    assert [p.key for p in points] == [(a.trajectory_id, a.message_index) for a in annotated]

    result = extract(points, tmp_path / "out", prompter, live, shard_size=SHARD, progress=False)
    assert (result.computed_shards, result.skipped_shards, result.computed_points) == (3, 0, 12)
    full, recent2, meta = load_states(tmp_path / "out")
    d = 128
    assert full.shape == recent2.shape == (12, d) and full.dtype == recent2.dtype == np.float32

    by_id = {t["id"]: t for t in trajectories}
    tokenizer = prompter.tokenizer
    prompts, kinds = [], []
    for point, row in zip(annotated, meta):
        messages = by_id[point.trajectory_id]["messages"]
        ctx = next(p for p in points if p.key == (point.trajectory_id, point.message_index)).context
        full_ids, full_total, full_cut = _expected_ids(tokenizer, messages[: point.message_index], keep_head)
        recent_messages = messages[: ctx.prefix_end] + messages[ctx.old_end : point.message_index]
        recent_ids, recent_total, recent_cut = _expected_ids(tokenizer, recent_messages, keep_head)
        assert (row["full_tokens"], row["context_tokens"], row["truncated"]) == (len(full_ids), full_total, full_cut)
        assert (row["recent2_tokens"], row["recent2_context_tokens"], row["recent2_truncated"]) == (
            len(recent_ids),
            recent_total,
            recent_cut,
        )
        # the annotation's labels and context travel with the row
        assert row["trajectory_id"] == point.trajectory_id and row["message_index"] == point.message_index
        for name in ("source", "step", "turn", "last_tool", "recall", "compression", "n_old_blocks"):
            assert row[name] == getattr(point, name), name
        prompts += [full_ids, recent_ids]
        kinds += [full_cut, recent_cut]
    assert any(kinds) and not all(kinds), "both cut and whole prompts are exercised"
    # Recent2 drops the old blocks once there are any
    assert any(r["recent2_context_tokens"] < r["context_tokens"] for r in meta)

    reference = hf_last_token_states(model_dir, prompts)
    cos_full = _cosines(full, reference[0::2])
    cos_recent = _cosines(recent2, reference[1::2])
    assert cos_full.min() >= 0.999, cos_full
    assert cos_recent.min() >= 0.999, cos_recent


def test_resume_and_settings_guard(engine, labelled, tmp_path):
    live, model_dir = engine
    data, labels, _, _annotated = labelled
    prompter = _prompter(model_dir, 64)
    points = join_points(load_labels(labels), load_data([data]))
    out = tmp_path / "out"
    first = extract(points, out, prompter, live, shard_size=SHARD, settings={"dtype": "float32"}, progress=False)
    assert first.computed_shards == 3
    full, recent2, meta = load_states(out)

    def no_engine():
        raise AssertionError("a complete run must not start an engine")

    again = extract(points, out, prompter, no_engine, shard_size=SHARD, settings={"dtype": "float32"}, progress=False)
    assert (again.computed_shards, again.skipped_shards, again.computed_points) == (0, 3, 0)
    full2, recent2_2, meta2 = load_states(out)
    assert np.array_equal(full, full2) and np.array_equal(recent2, recent2_2) and meta == meta2

    # a shard that did not finish (no JSON lines yet) is redone, the others kept
    (out / "states-00001.jsonl").unlink()
    with pytest.raises(StatesError, match="missing"):
        load_states(out)
    assert len(load_states(out, allow_partial=True)[2]) == 7
    resumed = extract(points, out, prompter, live, shard_size=SHARD, settings={"dtype": "float32"}, progress=False)
    assert (resumed.computed_shards, resumed.skipped_shards) == (1, 2)
    full3, recent2_3, meta3 = load_states(out)
    assert meta3 == meta
    assert np.allclose(full3, full, atol=1e-4) and np.allclose(recent2_3, recent2, atol=1e-4)

    # each shard names the engine's dtype; a sitting whose engine computes in another is refused
    assert {shard_dtype(out, i) for i in range(3)} == {live.dtype} == {"float32"}
    rows = meta[:SHARD]
    write_shard(out, 0, {"full": full[:SHARD], "recent2": recent2[:SHARD]}, rows, dtype="bfloat16")
    (out / "states-00001.jsonl").unlink()
    with pytest.raises(ExtractError, match="shards done in bfloat16, float32, this engine runs float32"):
        extract(points, out, prompter, live, shard_size=SHARD, settings={"dtype": "float32"}, progress=False)
    write_shard(out, 0, {"full": full[:SHARD], "recent2": recent2[:SHARD]}, rows, dtype="float32")
    extract(points, out, prompter, live, shard_size=SHARD, settings={"dtype": "float32"}, progress=False)
    assert np.allclose(load_states(out)[0], full, atol=1e-4)

    # another selection or other settings never mix into this directory
    with pytest.raises(StatesError, match="other settings"):
        extract(points[:4], out, prompter, no_engine, shard_size=SHARD, settings={"dtype": "float32"}, progress=False)
    with pytest.raises(StatesError, match="other settings"):
        extract(
            points,
            out,
            _prompter(model_dir, 128),
            no_engine,
            shard_size=SHARD,
            settings={"dtype": "float32"},
            progress=False,
        )
    with pytest.raises(StatesError, match="other settings"):  # the full context alone is another run
        extract(points, out, prompter, no_engine, shard_size=SHARD, settings={"dtype": "float32"}, inputs=["full"])

    # the full context alone: the same states, half the prompts, no Recent2 to read
    alone = extract(points, tmp_path / "full", prompter, live, shard_size=SHARD, progress=False, inputs=["full"])
    assert (alone.computed_points, alone.inputs) == (12, 1)
    full4, recent2_4, meta4 = load_states(tmp_path / "full")
    assert recent2_4 is None and np.allclose(full4, full, atol=1e-4)
    assert meta4 == meta  # Recent2's token counts too: the length control reads them

    # sittings: a deadline already passed still computes one shard, then stops; the same call resumes
    sit = tmp_path / "sit"
    first_sitting = extract(
        points, sit, prompter, live, shard_size=SHARD, progress=False, inputs=["full"], stop_after_s=0
    )
    assert (first_sitting.computed_shards, first_sitting.skipped_shards, first_sitting.left) == (1, 0, 2)
    second = extract(points, sit, prompter, live, shard_size=SHARD, progress=False, inputs=["full"])
    assert (second.computed_shards, second.skipped_shards, second.left) == (2, 1, 0)
    full5, _, meta5 = load_states(sit)
    assert meta5 == meta and np.allclose(full5, full4, atol=1e-4)


def test_layerwise_states_match_hf(labelled, tmp_path, tokenizer_dir):
    """``--layers``: block 1 (the residual stream after the first layer) and the
    final norm, last token and mean over every prompt token, equal HF's
    ``hidden_states``, also when prompts are prefilled in 64-token chunks."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model("llama", tmp_path / "model", tokenizer_dir)
    data, labels, _, _ = labelled
    points = join_points(load_labels(labels), load_data([data]))[::3]  # 4 points, whole and cut prompts
    prompter = _prompter(model_dir, 64)
    with CaptureEngine(
        model_dir,
        max_model_len=MAX_MODEL_LEN,
        dtype="float32",
        gpu_memory_utilization=0.15,
        max_num_batched_tokens=64,
        layers=[1],
    ) as live:
        assert not live.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching  # every token computed
        extract(points, tmp_path / "out", prompter, live, shard_size=3, progress=False, layers=[1])
    last, mean, names, meta = load_layer_states(tmp_path / "out")
    full, _, _ = load_states(tmp_path / "out")
    assert names == ["block1", "norm"] and last.shape == mean.shape == (4, 2, 128)
    assert np.allclose(last[:, 1], full, atol=1e-5)  # the norm tap's last row is the captured state

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for i, point in enumerate(points):
            ids = prompter(point.full_messages()).ids
            assert meta[i]["full_tokens"] == len(ids)
            out = hf.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
            streams = [out.hidden_states[1][0], out.last_hidden_state[0]]
            for tap, stream in enumerate(streams):
                for ours, expected in ((last[i, tap], stream[-1]), (mean[i, tap], stream.mean(dim=0))):
                    cosine = torch.nn.functional.cosine_similarity(torch.from_numpy(ours.copy()), expected, dim=0)
                    assert cosine.item() >= 0.999, (i, names[tap], cosine.item())
    # a directory of a run without --layers has no layer states to read
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "manifest.json").write_text(json.dumps(run_manifest(points, prompter, SHARD)))
    with pytest.raises(StatesError, match="without --layers"):
        load_layer_states(plain)


def test_selection_is_deterministic(labelled):
    data, labels, _, _ = labelled
    points = join_points(load_labels(labels), load_data([data]))
    a = select_points(points, subsample=5, seed=3)
    assert [p.key for p in a] == [p.key for p in select_points(points, subsample=5, seed=3)]
    assert len(a) == 5 and a == sorted(a, key=points.index)
    assert len(select_points(points, subsample=0.5, seed=3)) == 6
    assert [p.key for p in select_points(points, limit=4)] == [p.key for p in points[:4]]


def test_labels_must_match_the_data(labelled, tmp_path):
    data, labels, trajectories, _annotated = labelled
    with pytest.raises(ExtractError, match="not in the data"):
        join_points(load_labels(labels), load_data([data])[:1])
    # labels of another n_recent do not fit this split
    with pytest.raises(ExtractError, match="n-recent"):
        join_points(
            [p for t in trajectories for p in annotate_trajectory(t, char_counter, n_recent=1)],
            trajectories,
            n_recent=2,
        )
