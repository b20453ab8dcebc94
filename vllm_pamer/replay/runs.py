"""A resumable replay run over sittings: trajectories in named groups, every
policy run on a group before the next group starts, each finished (group,
policy) *unit* saved at once, so a run stopped anywhere resumes after its last
unit and still compares every policy on the same trajectories. What
``vllm-pamer replay --group-size`` runs (``replay/cli.py``), and
``benchmarks/policies.py`` over this repository's data.

All units of a run live in one file, ``OUT/units.jsonl.gz``: one gzip member
per unit, appended. A member torn by a killed sitting is cut off when the file
is next opened. ``OUT/settings.json`` holds what a resume must repeat, the
code each sitting ran and the KV budget its server reported. The report
(``OUT/report.md``, ``replay/run_report.py``) covers the groups every policy
finished.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import json
import os
import re
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from vllm_pamer.replay.client import ReplaySettings, TrajectoryPlan, connect, replay_policy
from vllm_pamer.replay.compactions import read_compactions
from vllm_pamer.replay.records import RunSummary, StepRecord
from vllm_pamer.server_process import ServerProcess

UNITS_FILE = "units.jsonl.gz"
SITTING_FLAGS = ("--stop-after-min", "--rerun")
"""Flags with a value that concern one sitting, not the run."""
KV_TOKENS_RE = re.compile(r"KV cache size: ([\d,]+) tokens")


@dataclass(frozen=True)
class GroupedRun:
    """One resumable run: where it lives, what it replays, what a resume must repeat."""

    out: Path
    groups: list[tuple[str, list[TrajectoryPlan]]]
    """Named groups of plans (``make_groups``), run in this order."""
    policies: list[str]
    settings: dict[str, Any]
    """What a resume must repeat (``settings.json``)."""
    code: str
    """The code of this sitting: a commit, or ``vllm-pamer X.Y.Z``."""


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


def check_settings(out: Path, settings: dict, commit: str, running: bool = True) -> list[str]:
    """Write ``settings.json`` on a first run; on a resume, refuse other settings.
    Returns the code that ran so far (``commit`` appended when ``running``):
    commits of this repository, or ``vllm-pamer X.Y.Z`` for a user's run."""
    path = out / "settings.json"
    if path.exists():
        saved = json.loads(path.read_text())
        commits = saved.pop("commits", [])
        kv_tokens = saved.pop("kv_cache_tokens", None)  # what the server reported, not an option
        reruns = saved.pop("reruns", [])
        additions = saved.pop("added", [])
        # an option added since the run began reads as unset (None) in it
        changed = sorted(k for k in {*saved, *settings} if saved.get(k) != settings.get(k))
        new_policies = _added_policies(saved.get("policies"), settings.get("policies"))
        if new_policies and changed == ["policies"]:
            # policies appended to a run: the same requests, the new ones run on every group
            changed = []
            additions.append({"policies": new_policies, "commit": commit})  # saved below: noted once
        if changed:
            raise SettingsMismatch(
                f"{out} holds a run with other settings ({', '.join(changed)}): "
                "pass the same options to resume it, or another --out"
            )
    else:
        commits, kv_tokens, reruns, additions = [], None, [], []
    if running and commit not in commits:
        commits.append(commit)
    out.mkdir(parents=True, exist_ok=True)
    extra: dict[str, Any] = {"kv_cache_tokens": kv_tokens} if kv_tokens is not None else {}
    if reruns:
        extra["reruns"] = reruns
    if additions:
        extra["added"] = additions
    path.write_text(json.dumps({**settings, "commits": commits, **extra}, indent=2) + "\n")
    return commits


def _added_policies(saved: object, wanted: object) -> list[str]:
    """The policies ``wanted`` (a comma list) appends to ``saved``'s, in order;
    empty unless ``wanted`` keeps every saved policy in its place."""
    if not isinstance(saved, str) or not isinstance(wanted, str):
        return []
    before, after = saved.split(","), wanted.split(",")
    return after[len(before) :] if after[: len(before)] == before else []


def note_rerun(out: Path, policies: Sequence[str], commit: str, dropped: int) -> None:
    """Record in settings.json that ``policies``' saved units were dropped to run
    again at ``commit`` (their code changed), so the report's code list says why."""
    path = out / "settings.json"
    saved = json.loads(path.read_text())
    saved.setdefault("reruns", []).append({"policies": list(policies), "commit": commit, "units_dropped": dropped})
    path.write_text(json.dumps(saved, indent=2) + "\n")


def reruns(out: Path) -> str:
    """The run's reruns and added policies for a report (empty when none)."""
    path = out / "settings.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    again = "".join(
        f" {', '.join(r['policies'])} run again from {r['commit']} ({r['units_dropped']} units dropped)."
        for r in saved.get("reruns", [])
    )
    return again + "".join(f" {', '.join(a['policies'])} added at {a['commit']}." for a in saved.get("added", []))


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

    def __init__(self, out: Path, repair: bool = True) -> None:
        """``repair``: cut off a unit torn by a killed sitting (the sitting
        that writes the run); a reader of a run that may be running says False."""
        self.path = Path(out) / UNITS_FILE
        self._units: dict[tuple[str, str], Unit] = {}
        if self.path.exists():
            data = self.path.read_bytes()
            good = 0
            for end, payload in _members(data):
                unit = msgspec.json.decode(payload, type=Unit)
                self._units[(unit.run.group, unit.run.policy)] = unit
                good = end
            if repair and good < len(data):  # a torn unit of a killed sitting: gone, it runs again
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

    def units(self) -> list[Unit]:
        """Every saved unit, in the order saved."""
        return list(self._units.values())

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
                run.compactions = await read_compactions(client, settings.url, (r.session_id for r in records))
                store.add(Unit(run, records))
                ran += 1
    return ran


def run_command(program: str, argv: list[str], root: Path) -> str:
    """The command that (re)produces the run: ``program`` and ``argv`` without
    the sitting's own flags (``--stop-after-min``, ``--rerun``,
    ``--report-only``), paths relative to ``root``."""
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
    return " ".join([program, *words])


def sit(
    run: GroupedRun,
    replay: ReplaySettings,
    start_server: Callable[[], ServerProcess] | None = None,
    stop_after_min: float | None = None,
    rerun: Sequence[str] = (),
    report_only: bool = False,
) -> list[str]:
    """One sitting of ``run``: refuse a resume with other settings; unless
    ``report_only``, start the run's own server (``start_server``, not waited
    for; None: ``replay.url`` serves) and note its KV budget, drop the saved
    units of the ``rerun`` policies, and run the units not saved yet, starting
    none after ``stop_after_min``. Returns the code that ran so far."""
    commits = check_settings(run.out, run.settings, run.code, running=False)
    if report_only:
        return commits
    server = start_server() if start_server is not None else None
    try:
        if server is not None:
            server.wait_ready(timeout=900)
            note_kv_budget(run.out, server.log_path.read_text(errors="replace"))  # refuses another budget
            replay = dataclasses.replace(replay, url=server.base_url)
        commits = check_settings(run.out, run.settings, run.code)  # this sitting's code joins the run
        store = UnitStore(run.out)
        if rerun:
            dropped = store.drop(rerun)
            note_rerun(run.out, rerun, run.code, dropped)
            print(f"dropped {dropped} saved units of {', '.join(rerun)}: they run again")
        stop = stop_after_min * 60 if stop_after_min is not None else None
        ran = asyncio.run(run_units(replay, run.groups, run.policies, store, stop))
    finally:
        if server is not None:
            server.stop()
    print(f"{ran} (group, policy) runs this time" + (f"; server log {server.log_path}" if server else ""))
    return commits
