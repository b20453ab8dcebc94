"""Do two runs of the policies benchmark make the same decisions? Per request
of every (group, policy) both saved: the action, the memory ids shown, the
compaction's trigger, the prompt tokens and characters sent, the status. For a
change meant to alter no behaviour (a refactor): run the same command at both
commits into two ``--out`` folders, then

    .venv/bin/python -m benchmarks.same_decisions BEFORE_OUT AFTER_OUT

Prints the requests compared, those that differ (the first 20 of them) and
exits 1 when any does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from vllm_pamer.replay.records import key_of
from vllm_pamer.replay.runs import UnitStore


def decisions(out: Path) -> dict[tuple[str, str, str, int], tuple[Any, ...]]:
    found: dict[tuple[str, str, str, int], tuple[Any, ...]] = {}
    for unit in UnitStore(out, repair=False).units():  # another sitting may be writing it
        for r in unit.records:
            pamer = r.pamer or {}
            schedule = pamer.get("schedule") or {}
            key = (unit.run.group, unit.run.policy, key_of(r), r.step)
            found[key] = (
                pamer.get("action"),
                tuple(pamer.get("recalled") or ()),
                schedule.get("trigger"),
                r.prompt_tokens_out,
                r.chars_sent,
                r.status,
            )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    a, b = decisions(args.before), decisions(args.after)
    both = sorted(set(a) & set(b))
    differ = [k for k in both if a[k] != b[k]]
    print(f"{len(both)} requests in both runs ({len(a)} before, {len(b)} after); {len(differ)} differ")
    for key in differ[:20]:
        print(f"  {key}: {a[key]} -> {b[key]}")
    return 1 if differ or not both else 0


if __name__ == "__main__":
    sys.exit(main())
