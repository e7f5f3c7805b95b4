"""Helpers every benchmark uses: timing, the result record and its printing.

A benchmark module ``bench/<name>.py`` defines ``main(argv=None) -> list[dict]``. Each
dict comes from :func:`result`; ``deltastream bench <name> [--json]`` prints them.
Every figure is set against a baseline measured in the same run, because the machines
these run on are shared and noisy: the ratio is what is compared with the goal.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterable

__all__ = ["result", "best_time", "emit"]


def result(name: str, value: float, baseline: float, goal: float | None, unit: str, *,
           ratio: float | None = None, higher_is_better: bool = True, **extra) -> dict:
    """One benchmark figure.

    ``ratio`` defaults to ``value / baseline`` (both throughputs, higher is better). Pass it
    explicitly when the figure is a time or an overhead. ``goal`` is a goal for the ratio
    (``ratio >= goal`` passes, or ``<=`` with ``higher_is_better=False``); ``None`` = report only.
    """
    if ratio is None:
        ratio = value / baseline if baseline else float("nan")
    if goal is None:
        ok = None
    else:
        ok = bool(ratio >= goal) if higher_is_better else bool(ratio <= goal)
    rec = {"name": name, "value": value, "baseline": baseline, "ratio": ratio, "goal": goal,
           "unit": unit, "higher_is_better": higher_is_better, "pass": ok}
    rec.update(extra)
    return rec


def best_time(fn: Callable[[], object], *, repeat: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeat`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def emit(results: Iterable[dict], as_json: bool) -> None:
    """Print results: one JSON object per line, or an aligned human table."""
    results = list(results)
    if as_json:
        for r in results:
            print(json.dumps(r, sort_keys=False))
        return
    for r in results:
        status = {True: "PASS", False: "SHORT", None: "info"}[r["pass"]]
        goal = "" if r["goal"] is None else ("≥ " if r["higher_is_better"] else "≤ ") + f"{r['goal']:g}"
        print(f"{r['name']:<40} {r['value']:>14.4g} {r['unit']:<10} baseline {r['baseline']:>12.4g}"
              f"  ratio {r['ratio']:>8.3f}  goal {goal:<8} {status}")
