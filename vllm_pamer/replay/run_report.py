"""The report of a resumable run (``replay/runs.py``): ``OUT/report.md`` over
the groups every policy finished, and its serving figures against another
run's on the groups both finished."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_pamer.replay.records import PolicyRow
from vllm_pamer.replay.report import KIND_TITLES, fmt, markdown_table, summarize, write_report
from vllm_pamer.replay.runs import GroupedRun, UnitStore, kv_budget, reruns


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
    run: GroupedRun,
    commits: list[str],
    workload: str,
    command: str,
    trajectories: list[dict[str, Any]],
    against: str | None = None,
    paired: str | None = None,
) -> list[PolicyRow] | None:
    """``OUT/report.md`` (and the report's other files) over the groups every
    policy finished, headed by what ran: the trajectories, the ``workload``
    (how many requests each, sessions at a time, ...), the KV budget, the
    ``commits`` that ran and the ``command`` that resumes it. ``trajectories``:
    the replayed ones, for the over-recency column. ``against``: another run's
    folder to compare serving figures with. ``paired``: a policy set against
    each other one, request by request. Returns the rows (None: no group
    finished yet)."""
    out, groups, policies = run.out, run.groups, run.policies
    store = UnitStore(out, repair=False)  # a report never changes the units file
    complete = [(g, plans) for g, plans in groups if store.complete([g], policies)]
    if not complete:
        print("no group finished by every policy yet: no report")
        return None
    units = store.load([g for g, _ in complete], policies)
    kinds = {k: sum(len(plans) for g, plans in complete if g.startswith(k)) for k in ("tau", "swe")}
    text = (
        f"{len(complete)} of {len(groups)} groups finished by all {len(policies)} policies: "
        f"{kinds['tau']} tau-bench and {kinds['swe']} mini-swe trajectories {workload}, "
        f"KV cache of {kv_budget(out)} tokens. Code: {', '.join(commits)}.{reruns(out)} Command: `{command}`\n"
    )
    rows = write_report(
        out,
        [r for u in units for r in u.records],
        [u.run for u in units],
        records_name=None,
        title="Policies side by side",
        preface=text,
        trajectories=trajectories,
        paired=paired,
    )
    print(markdown_table(rows))
    print(text)
    if against:
        section = against_section(store, UnitStore(Path(against), repair=False), against, groups, policies)
        with (out / "report.md").open("a") as report_md:
            report_md.write(section or f"\nNo group finished by every policy in both this run and {against}.\n")
        print(section)
    return rows
