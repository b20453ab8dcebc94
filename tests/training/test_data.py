"""The states a run extracts (``training/data.py``): read back as written, and
refused (or read partially when asked) while shards are missing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.support.training_fixtures import synthetic_states, write_shards, write_states_dir
from vllm_pamer.training.annotate import DecisionPoint
from vllm_pamer.training.data import StatesError, load_states, relabel, shard_complete, shard_dtype, write_shard


def test_load_states_round_trip_and_completeness(tmp_path):
    full, recent2, meta = synthetic_states(d=8, n_tau=2, n_swe=2)
    write_shards(tmp_path / "s", full, recent2, meta, n_shards=3)
    f2, r2, m2 = load_states(tmp_path / "s")
    np.testing.assert_array_equal(f2, full)
    np.testing.assert_array_equal(r2, recent2)
    assert f2.dtype == r2.dtype == np.float32 and m2 == meta
    # the manifest plans more shards than are complete: refused unless partial
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    (tmp_path / "s" / "manifest.json").write_text(json.dumps({**manifest, "shards": 4}))
    with pytest.raises(StatesError, match="1 of 4 shards are missing"):
        load_states(tmp_path / "s")
    assert len(load_states(tmp_path / "s", allow_partial=True)[2]) == len(meta)
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(manifest))
    # a shard whose JSON lines are not written yet is incomplete
    first = len(meta) - len(np.array_split(np.arange(len(meta)), 3)[2])
    (tmp_path / "s" / "states-00002.jsonl").unlink()
    with pytest.raises(StatesError, match="missing"):
        load_states(tmp_path / "s")
    f3, _, m3 = load_states(tmp_path / "s", allow_partial=True)
    assert len(m3) == first == f3.shape[0] and m3 == meta[:first]
    (tmp_path / "s" / "states-00001.jsonl").write_text(json.dumps(meta[0]) + "\n")
    with pytest.raises(StatesError, match="rows do not match"):
        load_states(tmp_path / "s", allow_partial=True)
    # no shard at all, or no manifest: not an extraction to train on
    for name in ("states-00000.jsonl", "states-00001.jsonl"):
        (tmp_path / "s" / name).unlink()
    with pytest.raises(StatesError, match="no complete shard"):
        load_states(tmp_path / "s", allow_partial=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(StatesError, match="manifest"):
        load_states(tmp_path / "empty")


def test_shards_of_different_engine_dtypes_are_not_read_together(tmp_path):
    """`--dtype auto` is fp32 on one CPU and bf16 on another: sittings on two
    machines must not mix in one directory unnoticed."""
    full, recent2, meta = synthetic_states(d=8, n_tau=2, n_swe=2)
    write_shards(tmp_path / "s", full, recent2, meta, n_shards=2)
    halves = np.array_split(np.arange(len(meta)), 2)
    assert shard_dtype(tmp_path / "s", 0) is None  # written without one: not recorded

    def rewrite(index, dtype):
        rows = halves[index]
        tensors = {"full": full[rows], "recent2": recent2[rows]}
        write_shard(tmp_path / "s", index, tensors, [meta[i] for i in rows], dtype=dtype)

    rewrite(0, "bfloat16")
    with pytest.raises(StatesError, match=r"different engine dtypes \(bfloat16: 1, not recorded: 1 shards\)"):
        load_states(tmp_path / "s")
    rewrite(1, "float32")
    with pytest.raises(StatesError, match="bfloat16: 1, float32: 1"):
        load_states(tmp_path / "s")
    rewrite(1, "bfloat16")
    assert shard_dtype(tmp_path / "s", 1) == "bfloat16"
    np.testing.assert_array_equal(load_states(tmp_path / "s")[0], full)


def test_states_of_the_full_context_alone_read_back_without_recent2(tmp_path):
    full, _, meta = synthetic_states(d=8, n_tau=2, n_swe=2)
    write_states_dir(tmp_path / "s", {"full": full}, meta, 2, inputs=["full"])
    f2, r2, m2 = load_states(tmp_path / "s")
    np.testing.assert_array_equal(f2, full)
    assert r2 is None and m2 == meta
    keys = [(m["trajectory_id"], m["message_index"]) for m in meta[: len(np.array_split(meta, 2)[0])]]
    assert shard_complete(tmp_path / "s", 0, keys, inputs=("full",))
    assert not shard_complete(tmp_path / "s", 0, keys)  # a run of both inputs would compute it again
    # a manifest that names both inputs over shards of one is refused, not read short
    write_states_dir(tmp_path / "t", {"full": full}, meta, 1)
    with pytest.raises(StatesError, match="recent2"):
        load_states(tmp_path / "t")


def test_relabel_takes_another_annotators_labels_by_point():
    meta = [
        {"trajectory_id": "t", "message_index": 4, "compression": 0, "recall": 1, "annotator": "reference"},
        {"trajectory_id": "t", "message_index": 6, "compression": 1, "recall": 0, "annotator": "reference"},
    ]
    point = DecisionPoint(
        trajectory_id="t",
        step=1,
        message_index=4,
        n_messages=4,
        n_old_blocks=2,
        old_tokens=2000,
        turn=1,
        last_tool=None,
        recall=1,
        compression=1,
        recall_values=[],
        source="hand",
        annotator="hindsight",
    )
    ours = relabel(meta, [point])
    assert [(m["compression"], m["annotator"]) for m in ours] == [(1, "hindsight"), (None, "")]
    assert ours[1]["recall"] is None and meta[0]["compression"] == 0  # the rows read are left as they were
