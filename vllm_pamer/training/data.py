"""The files of the training pipeline: the extracted-states format (written by
``vllm-pamer extract``, read by ``vllm-pamer train``), the labels file of
``vllm-pamer annotate`` and the trajectory data files. This module is the
only writer and the only reader of the states format.

An extraction directory holds ``manifest.json`` (the run's settings, the
planned shard count ``shards``, for a ``--layers`` run the tap names
``layers``, for a run of the full context alone ``inputs``), then per shard
``states-00000.safetensors`` (tensors ``full`` and ``recent2`` or ``full``
alone, ``[n, d]`` float32; with ``--layers`` also ``layers_last`` and
``layers_mean``, ``[n, taps, d]``) and ``states-00000.jsonl`` (one metadata
line per row). Both shard files are written to a temporary name and renamed,
the JSON lines last. A shard's safetensors metadata names the engine's dtype
(``dtype``): ``dtype: auto`` resolves per machine (a CPU without native bf16
runs fp32, ``adapters/vllm_from_0_32/cpu.py``), so sittings on different
machines could otherwise mix dtypes in one directory; the reader refuses that.

Completeness: the manifest says how many shards were planned; a shard counts
once both its files exist, and a directory with planned shards missing is an
error unless ``allow_partial`` (then the complete ones are read). A directory
without a manifest is not an extraction directory.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from vllm_pamer.training.annotate import DecisionPoint

STATE_NAMES = ("full", "recent2")
LAYER_NAMES = ("layers_last", "layers_mean")
FORMAT = "vllm-pamer-states/1"
MANIFEST = "manifest.json"


class StatesError(ValueError):
    """A states directory or a labels file that does not read as planned."""


# --------------------------------------------------------------------------------------
# Shards
# --------------------------------------------------------------------------------------


def shard_paths(out_dir: str | Path, index: int) -> tuple[Path, Path]:
    base = Path(out_dir) / f"states-{index:05d}"
    return base.with_suffix(".safetensors"), base.with_suffix(".jsonl")


def _read_meta(path: Path) -> list[dict[str, Any]]:
    with open(path, "rb") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def shard_complete(
    out_dir: Path,
    index: int,
    keys: Sequence[tuple[str, int]],
    layered: bool = False,
    inputs: Sequence[str] = STATE_NAMES,
) -> bool:
    """Whether shard ``index`` holds exactly the points ``keys`` (resume):
    its JSON lines name them in order and every tensor (``inputs``, and the
    taps when ``layered``) has as many rows."""
    tensors_path, meta_path = shard_paths(out_dir, index)
    if not (tensors_path.exists() and meta_path.exists()):
        return False
    try:
        meta = _read_meta(meta_path)
        if [(m["trajectory_id"], m["message_index"]) for m in meta] != list(keys):
            return False
        from safetensors import safe_open

        with safe_open(str(tensors_path), framework="numpy") as f:
            names = tuple(inputs) + (LAYER_NAMES if layered else ())
            return all(name in f.keys() and f.get_slice(name).get_shape()[0] == len(keys) for name in names)  # noqa: SIM118
    except Exception:
        return False


def write_shard(
    out_dir: Path, index: int, tensors: Mapping[str, np.ndarray], meta: list[dict], dtype: str | None = None
) -> None:
    """``tensors``: ``full``, ``recent2`` unless left out (and the layer taps), ``len(meta)`` rows each.
    ``dtype``: the engine's, recorded in the shard (None: not known)."""
    from safetensors.numpy import save_file

    tensors_path, meta_path = shard_paths(out_dir, index)
    tmp = f".tmp-{os.getpid()}"
    save_file(
        {name: np.ascontiguousarray(array, dtype=np.float32) for name, array in tensors.items()},
        str(tensors_path) + tmp,
        metadata={"format": FORMAT, "rows": str(len(meta)), **({"dtype": dtype} if dtype else {})},
    )
    os.replace(str(tensors_path) + tmp, tensors_path)
    with open(str(meta_path) + tmp, "w") as handle:
        for row in meta:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(str(meta_path) + tmp, meta_path)  # last: marks the shard complete


def shard_dtype(out_dir: Path, index: int) -> str | None:
    """The engine dtype shard ``index`` was computed in (None: not recorded)."""
    from safetensors import safe_open

    with safe_open(str(shard_paths(out_dir, index)[0]), framework="numpy") as f:
        return (f.metadata() or {}).get("dtype")


# --------------------------------------------------------------------------------------
# The manifest
# --------------------------------------------------------------------------------------


def open_run(out_dir: Path, manifest: Mapping[str, Any]) -> None:
    """Write ``manifest`` into a new directory, or check that the directory
    holds the same run (a directory only resumes the run it was made for)."""
    path = out_dir / MANIFEST
    if path.exists():
        old = json.loads(path.read_text())
        differs = sorted(k for k in set(old) | set(manifest) if old.get(k) != manifest.get(k))
        if differs:
            raise StatesError(
                f"{out_dir} holds a run with other settings ({', '.join(differs)}); "
                "use another --out directory or remove it"
            )
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(dict(manifest), indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)


def read_manifest(out_dir: Path) -> dict[str, Any]:
    path = out_dir / MANIFEST
    if not path.exists():
        raise StatesError(f"{out_dir}: no {MANIFEST} (not an extraction directory)")
    return json.loads(path.read_text())


# --------------------------------------------------------------------------------------
# The reader
# --------------------------------------------------------------------------------------


def _read_shards(
    out_dir: Path, manifest: Mapping[str, Any], names: Sequence[str], ndim: int, allow_partial: bool
) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    """The tensors ``names`` of every complete planned shard, concatenated in
    shard order (float32), and their metadata rows."""
    from safetensors import safe_open

    tensors: dict[str, list[np.ndarray]] = {name: [] for name in names}
    meta: list[dict[str, Any]] = []
    dtypes: Counter[str | None] = Counter()
    missing = 0
    for index in range(int(manifest["shards"])):
        tensors_path, meta_path = shard_paths(out_dir, index)
        if not (meta_path.exists() and tensors_path.exists()):
            missing += 1
            continue
        rows = _read_meta(meta_path)
        with safe_open(str(tensors_path), framework="numpy") as f:  # one read: tensors and the dtype
            shard = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
            dtypes[(f.metadata() or {}).get("dtype")] += 1
        absent = [name for name in names if name not in shard]
        if absent:
            raise StatesError(f"{tensors_path}: missing tensors {absent} (has {sorted(shard)})")
        shapes = {shard[name].shape for name in names}
        if len(shapes) != 1 or len(next(iter(shapes))) != ndim:
            raise StatesError(
                f"{tensors_path}: tensors {list(names)} must have one {ndim}-D shape, not {sorted(shapes)}"
            )
        if next(iter(shapes))[0] != len(rows):
            raise StatesError(f"{tensors_path}: rows do not match {meta_path.name} ({len(rows)} metadata rows)")
        for name in names:
            tensors[name].append(shard[name].astype(np.float32, copy=False))
        meta.extend(rows)
    if missing and not allow_partial:
        raise StatesError(
            f"{out_dir}: {missing} of {manifest['shards']} shards are missing "
            "(run vllm-pamer extract again to finish, or pass --allow-partial / allow_partial=True)"
        )
    if not meta:
        raise StatesError(f"{out_dir}: no complete shard")
    if len(dtypes) > 1:
        order = sorted(dtypes, key=lambda dtype: (dtype is None, dtype or ""))  # recorded first
        counts = ", ".join(f"{dtype or 'not recorded'}: {dtypes[dtype]}" for dtype in order)
        raise StatesError(f"{out_dir}: shards computed in different engine dtypes ({counts} shards)")
    widths = {array.shape[1:] for array in tensors[names[0]]}
    if len(widths) != 1:
        raise StatesError(f"{out_dir}: shards disagree on the state shape: {sorted(widths)}")
    return {name: np.concatenate(tensors[name]) for name in names}, meta


def load_states(
    out_dir: str | Path, allow_partial: bool = False
) -> tuple[np.ndarray, np.ndarray | None, list[dict[str, Any]]]:
    """``(full [n, d], recent2 [n, d] or None, meta)`` of an extraction
    directory, rows in shard order; ``meta[k]`` describes row ``k``; None:
    extracted without Recent2 (``--inputs full``)."""
    out_dir = Path(out_dir)
    manifest = read_manifest(out_dir)
    tensors, meta = _read_shards(out_dir, manifest, tuple(manifest.get("inputs", STATE_NAMES)), 2, allow_partial)
    return tensors["full"], tensors.get("recent2"), meta


def load_layer_states(
    out_dir: str | Path, allow_partial: bool = False
) -> tuple[np.ndarray, np.ndarray, list[str], list[dict[str, Any]]]:
    """``(last [n, taps, d], mean [n, taps, d], tap names, meta)`` of a
    ``--layers`` extraction (full context), rows as in ``load_states``."""
    out_dir = Path(out_dir)
    manifest = read_manifest(out_dir)
    if not manifest.get("layers"):
        raise StatesError(f"{out_dir}: extracted without --layers (no layer states)")
    tensors, meta = _read_shards(out_dir, manifest, LAYER_NAMES, 3, allow_partial)
    return tensors["layers_last"], tensors["layers_mean"], list(manifest["layers"]), meta


# --------------------------------------------------------------------------------------
# Labels and trajectories
# --------------------------------------------------------------------------------------


def load_labels(path: str | Path) -> list[DecisionPoint]:
    """Decision points from a JSON lines file of ``vllm-pamer annotate``."""
    decoder = msgspec.json.Decoder(DecisionPoint)
    labels = []
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                try:
                    labels.append(decoder.decode(line))
                except msgspec.DecodeError as exc:
                    raise StatesError(f"{path}:{number}: not a decision point: {exc}") from None
    return labels


def relabel(meta: Sequence[Mapping[str, Any]], labels: Sequence[DecisionPoint]) -> list[dict[str, Any]]:
    """The extracted rows with another annotator's labels (``vllm-pamer train
    --labels``), matched by trajectory and message index; a row the labels do
    not name has none (it is left out of training)."""
    by_point = {(p.trajectory_id, p.message_index): p for p in labels}
    fields = ("recall", "compression", "annotator")
    out = []
    for row in meta:
        point = by_point.get((str(row["trajectory_id"]), int(row["message_index"])))
        values = (point.recall, point.compression, point.annotator) if point else (None, None, "")
        out.append({**row, **dict(zip(fields, values))})
    return out


def load_data(paths: Sequence[str | Path] | None, limit: int | None = None) -> list[dict[str, Any]]:
    """Trajectories of ``paths`` in order (default: both shipped samples),
    the first ``limit`` of each file when given."""
    from vllm_pamer.trajectories import SHIPPED, load_trajectories

    if paths:
        sets = [load_trajectories(p) for p in paths]
    else:
        sets = [load_trajectories(None, kind) for kind in SHIPPED]
    return [t for trajectories in sets for t in (trajectories[:limit] if limit is not None else trajectories)]
