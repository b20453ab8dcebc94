"""A long replay benchmark spread over sittings: trajectories in named groups,
every policy run on a group before the next group starts, each finished
(group, policy) *unit* saved at once, so a run stopped anywhere resumes after
its last unit and still compares every policy on the same trajectories.

All units of a run live in one file, ``OUT/units.jsonl.gz``: one gzip member
per unit, appended. A member torn by a killed sitting is cut off when the file
is next opened. ``OUT/settings.json`` holds what a resume must repeat.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec

from vllm_pamer.replay.client import ReplaySettings, TrajectoryPlan, connect, replay_policy
from vllm_pamer.replay.records import PolicyRow, RunSummary, StepRecord
from vllm_pamer.replay.report import KIND_TITLES, fmt, markdown_table, summarize, write_report

UNITS_FILE = "units.jsonl.gz"
SITTING_FLAGS = ("--stop-after-min", "--rerun")
"""Flags with a value that concern one sitting, not the run."""
KV_TOKENS_RE = re.compile(r"KV cache size: ([\d,]+) tokens")


class Unit(msgspec.Struct):
    """One policy's run over one group."""

    run: RunSummary
    records: list[StepRecord]


class SettingsMismatch(SystemExit):
    """A resume with other settings than the run it would continue."""


def make_groups(
    tau: list[TrajectoryPlan], swe: list[TrajectoryPlan], tau_size: int, swe_size: int
) -> list[tuple[str, list[TrajectoryPlan]]]:
    """Named groups of plans, tau and swe interleaved (a swe group first, then
    one every so many tau groups), so any prefix of the run holds both kinds."""
    tau_groups = [(f"tau-{i // tau_size:03d}", tau[i : i + tau_size]) for i in range(0, len(tau), tau_size)]
    swe_groups = [(f"swe-{i // swe_size:03d}", swe[i : i + swe_size]) for i in range(0, len(swe), swe_size)]
    every = max(1, len(tau_groups) // max(1, len(swe_groups)))
    groups: list[tuple[str, list[TrajectoryPlan]]] = []
    for i, group in enumerate(tau_groups):
        if i % every == 0 and swe_groups:
            groups.append(swe_groups.pop(0))
        groups.append(group)
    return groups + swe_groups


def git_commit(root: Path) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def check_settings(out: Path, settings: dict, commit: str, running: bool = True) -> list[str]:
    """Write ``settings.json`` on a first run; on a resume, refuse other settings.
    Returns the commits that ran so far (``commit`` appended when ``running``)."""
    path = out / "settings.json"
    if path.exists():
        saved = json.loads(path.read_text())
        commits = saved.pop("commits", [])
        kv_tokens = saved.pop("kv_cache_tokens", None)  # what the server reported, not an option
        reruns = saved.pop("reruns", [])
        # an option added since the run began reads as unset (None) in it
        changed = sorted(k for k in {*saved, *settings} if saved.get(k) != settings.get(k))
        if changed:
            raise SettingsMismatch(
                f"{out} holds a run with other settings ({', '.join(changed)}): "
                "pass the same options to resume it, or another --out"
            )
    else:
        commits, kv_tokens, reruns = [], None, []
    if running and commit not in commits:
        commits.append(commit)
    out.mkdir(parents=True, exist_ok=True)
    extra: dict[str, Any] = {"kv_cache_tokens": kv_tokens} if kv_tokens is not None else {}
    if reruns:
        extra["reruns"] = reruns
    path.write_text(json.dumps({**settings, "commits": commits, **extra}, indent=2) + "\n")
    return commits


def note_rerun(out: Path, policies: Sequence[str], commit: str, dropped: int) -> None:
    """Record in settings.json that ``policies``' saved units were dropped to run
    again at ``commit`` (their code changed), so the report's code list says why."""
    path = out / "settings.json"
    saved = json.loads(path.read_text())
    saved.setdefault("reruns", []).append({"policies": list(policies), "commit": commit, "units_dropped": dropped})
    path.write_text(json.dumps(saved, indent=2) + "\n")


def reruns(out: Path) -> str:
    """The run's reruns for a report (empty when none)."""
    path = out / "settings.json"
    noted = json.loads(path.read_text()).get("reruns", []) if path.exists() else []
    return "".join(
        f" {', '.join(r['policies'])} run again from {r['commit']} ({r['units_dropped']} units dropped)." for r in noted
    )


def note_kv_budget(out: Path, log_text: str) -> int | None:
    """The KV-cache budget the server reported (tokens), kept in settings.json.
    A sitting whose server holds another budget than the run's earlier ones
    (another machine sizes the cache by its own memory) is refused: the
    policies' figures depend on it."""
    match = KV_TOKENS_RE.search(log_text)
    if match is None:
        return None
    tokens = int(match.group(1).replace(",", ""))
    path = out / "settings.json"
    settings = json.loads(path.read_text())
    earlier = settings.get("kv_cache_tokens")
    if earlier is not None and earlier != tokens:
        raise SettingsMismatch(
            f"this server's KV cache holds {tokens:,} tokens, the earlier sittings of {out} had {earlier:,}: "
            "pass --kv-cache-blocks (the earlier tokens over the block size the log names) to hold the same"
        )
    settings["kv_cache_tokens"] = tokens
    path.write_text(json.dumps(settings, indent=2) + "\n")
    return tokens


def kv_budget(out: Path) -> str:
    path = out / "settings.json"
    tokens = json.loads(path.read_text()).get("kv_cache_tokens") if path.exists() else None
    return f"{tokens:,}" if tokens else "unreported"


def _members(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(end offset, payload) of each whole gzip member of ``data``; stops at a torn one."""
    offset = 0
    while offset < len(data):
        inflater = zlib.decompressobj(wbits=31)
        try:
            payload = inflater.decompress(data[offset:])
        except zlib.error:
            return
        if not inflater.eof:
            return
        offset = len(data) - len(inflater.unused_data)
        yield offset, payload


def _member(unit: Unit) -> bytes:
    """One unit as the gzip member the units file holds."""
    return gzip.compress(msgspec.json.encode(unit) + b"\n")


class UnitStore:
    """The units of one run (``OUT/units.jsonl.gz``), by (group, policy)."""

    def __init__(self, out: Path) -> None:
        self.path = Path(out) / UNITS_FILE
        self._units: dict[tuple[str, str], Unit] = {}
        if self.path.exists():
            data = self.path.read_bytes()
            good = 0
            for end, payload in _members(data):
                unit = msgspec.json.decode(payload, type=Unit)
                self._units[(unit.run.group, unit.run.policy)] = unit
                good = end
            if good < len(data):  # a torn unit of a killed sitting: gone, it runs again
                with self.path.open("r+b") as handle:
                    handle.truncate(good)

    def drop(self, policies: Sequence[str]) -> int:
        """Remove these policies' units (they run again); returns how many went."""
        gone = [key for key in self._units if key[1] in policies]
        for key in gone:
            del self._units[key]
        if gone:
            kept = b"".join(_member(u) for u in self._units.values())
            tmp = self.path.with_suffix(".tmp")
            tmp.write_bytes(kept)
            os.replace(tmp, self.path)  # a killed sitting leaves the old file or the new one
        return len(gone)

    def has(self, group: str, policy: str) -> bool:
        return (group, policy) in self._units

    def add(self, unit: Unit) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("ab") as handle:
            handle.write(_member(unit))
            handle.flush()
            os.fsync(handle.fileno())
        self._units[(unit.run.group, unit.run.policy)] = unit

    def load(self, groups: Sequence[str], policies: Sequence[str]) -> list[Unit]:
        """These groups' units, policy by policy in the order given (so merged
        report rows come out in that order)."""
        return [self._units[(g, p)] for p in policies for g in groups]

    def complete(self, groups: Sequence[str], policies: Sequence[str]) -> list[str]:
        """The groups every policy finished."""
        return [g for g in groups if all(self.has(g, p) for p in policies)]


async def run_units(
    settings: ReplaySettings,
    groups: list[tuple[str, list[TrajectoryPlan]]],
    policies: list[str],
    store: UnitStore,
    stop_after_s: float | None,
) -> int:
    """Each (group, policy) not saved yet, in order; returns how many ran."""
    started, ran = time.monotonic(), 0
    async with connect(settings) as (client, model):
        for group, plans in groups:
            for policy in policies:
                if store.has(group, policy):
                    continue
                if stop_after_s is not None and time.monotonic() - started > stop_after_s:
                    return ran
                print(f"{group} ({len(plans)} trajectories, {sum(len(p.steps) for p in plans)} requests): {policy}")
                records, run = await replay_policy(client, settings, model, policy, plans)
                run.group = group
                store.add(Unit(run, records))
                ran += 1
    return ran


def run_command(script: str, argv: list[str], root: Path) -> str:
    """The command that (re)produces the run: without the sitting's own flags
    (``--stop-after-min``, ``--rerun``, ``--report-only``), paths relative to ``root``."""
    words, skip = [], False
    for word in argv:
        if skip:
            skip = False
            continue
        if word in SITTING_FLAGS:
            skip = True
            continue
        if word == "--report-only" or word.startswith(tuple(f"{flag}=" for flag in SITTING_FLAGS)):
            continue
        path = Path(word)
        if path.is_absolute() and path.is_relative_to(root):
            word = str(path.relative_to(root))
        words.append(word)
    return " ".join([".venv/bin/python", "-m", script, *words])


def rows_by_policy(store: UnitStore, groups: list[str], policies: list[str]) -> dict[str, PolicyRow]:
    """The report rows of the saved units of these groups and policies, by policy."""
    units = store.load(groups, policies)
    return {row.policy: row for row in summarize([r for u in units for r in u.records], [u.run for u in units])}


def against_section(
    here: UnitStore, there: UnitStore, other: str, groups: list[tuple[str, list]], policies: list[str]
) -> str:
    """This run's serving figures next to another run's (say the same groups
    with more KV memory), per kind, on the groups both finished for every
    policy: steps / min and their ratio, peak KV use, prefill computed. The two
    runs ran one after the other, not interleaved: quote them as such."""
    parts = [f"\n## Against `{other}`\n\nThe same groups and policies in both runs; ratio = this run / that run.\n"]
    for kind in ("swe", "tau"):
        names = [g for g, _ in groups if g.startswith(kind)]
        shared = [g for g in here.complete(names, policies) if g in there.complete(names, policies)]
        if not shared:
            continue
        mine, theirs = rows_by_policy(here, shared, policies), rows_by_policy(there, shared, policies)
        trajectories = mine[policies[0]].trajectories
        parts += [
            f"\n### {KIND_TITLES.get(kind, kind)} ({len(shared)} groups, {trajectories} trajectories)\n",
            "| policy | mean peak context | peak KV | peak KV there | steps / min | steps / min there | ratio "
            "| prefill computed | prefill computed there | preemptions |",
            "|" + "---|" * 10,
        ]
        for policy in policies:
            a, b = mine[policy], theirs[policy]
            ratio = a.steps_per_min / b.steps_per_min if a.steps_per_min and b.steps_per_min else None
            cells = [
                policy,
                fmt(a.mean_peak_context),
                fmt(a.peak_kv_usage, "pct"),
                fmt(b.peak_kv_usage, "pct"),
                fmt(a.steps_per_min, "rate"),
                fmt(b.steps_per_min, "rate"),
                fmt(ratio, "rate"),
                fmt(a.prefill_computed),
                fmt(b.prefill_computed),
                fmt(a.preemptions),
            ]
            parts.append("| " + " | ".join(cells) + " |")
    return "\n".join(parts) + "\n" if len(parts) > 1 else ""


def write_finished_report(
    out: Path,
    groups: list[tuple[str, list[TrajectoryPlan]]],
    policies: list[str],
    preface: Callable[[int, dict[str, int]], str],
    trajectories: list[dict[str, Any]],
    against: str | None = None,
) -> list[PolicyRow] | None:
    """``OUT/report.md`` (and the report's other files) over the groups every
    policy finished; ``preface(finished groups, trajectories by kind)`` heads
    it. ``against``: another run's folder to compare serving figures with.
    Returns the rows (None: no group finished yet)."""
    store = UnitStore(out)
    complete = [(g, plans) for g, plans in groups if store.complete([g], policies)]
    if not complete:
        print("no group finished by every policy yet: no report")
        return None
    units = store.load([g for g, _ in complete], policies)
    kinds = {k: sum(len(plans) for g, plans in complete if g.startswith(k)) for k in ("tau", "swe")}
    text = preface(len(complete), kinds)
    rows = write_report(
        out,
        [r for u in units for r in u.records],
        [u.run for u in units],
        records_name=None,
        title="Policies side by side",
        preface=text,
        trajectories=trajectories,
    )
    print(markdown_table(rows))
    print(text)
    if against:
        section = against_section(store, UnitStore(Path(against)), against, groups, policies)
        with (out / "report.md").open("a") as report_md:
            report_md.write(section or f"\nNo group finished by every policy in both this run and {against}.\n")
        print(section)
    return rows
