"""Interleaved A/B rounds, each on a freshly started server: what the A/B
benchmarks (``benchmarks/overhead.py``, ``benchmarks/kv_budget.py``) share. A
shared helper, not a script.

Sides run a b b a a b b a ...: each side runs ``rounds`` times and a drift of
the machine linear in time falls on both sides alike. Each round starts its
side's server, waits for it, measures, and stops it even when the measurement
fails, so no engine outlives its round.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tqdm import tqdm

from vllm_pamer.server_process import ServerProcess

T = TypeVar("T")


def abba(rounds: int) -> list[int]:
    """Side indices a b b a a b b a ... with each side ``rounds`` times."""
    return [side for r in range(rounds) for side in ((0, 1) if r % 2 == 0 else (1, 0))]


def interleaved_rounds(
    rounds: int,
    start: Callable[[int, Path], ServerProcess],
    measure: Callable[[int, ServerProcess], T],
    describe: Callable[[int, T], str],
    prefix: str,
    sides: tuple[int, ...] = (0, 1),
) -> tuple[list[list[T]], Path]:
    """Run ``rounds`` rounds of each side in ``abba`` order.

    ``start(side, log)`` returns the side's server (not yet waited for);
    ``measure(side, server)`` its result; ``describe(side, result)`` the line
    printed after each round; ``sides``: the sides run (one alone: a re-run of
    that side, no comparison). Returns the results of sides a and b, in round
    order, and the folder that holds each round's server log."""
    logs = Path(tempfile.mkdtemp(prefix=prefix))
    results: list[list[T]] = [[], []]
    order = [side for side in abba(rounds) if side in sides]
    for index, side in enumerate(tqdm(order, desc="A/B rounds")):
        log = logs / f"{index}" / "server.log"
        log.parent.mkdir()
        server = start(side, log)
        try:
            server.wait_ready(timeout=900, progress=False)
            result = measure(side, server)
        finally:
            server.stop()
        results[side].append(result)
        tqdm.write(f"round {index + 1}: {describe(side, result)}")
    return results, logs
