"""Benchmark ``select_changed``: top 10 % of 1M candidate rows x 128 fp32.

The floor is a same-run copy of the bytes the selection must read: the current value of
every candidate row and its FIRST state (``torch.cat`` of the two dense tensors, i.e. one
read and one write of each byte). Selection has to read the same bytes (through the table's
id lookup), score them, choose the top fraction, gather the chosen rows and copy the
leftover FIRST states for ``retain``. ratio = floor_time / selection_time, goal >= 0.4.

On CUDA ``select_changed`` takes its Triton kernel path (``--kernels auto``, the default;
``off`` times the chunked torch path instead); the record then also carries
``torch_path_ms``, the same selection with kernels off, for comparison. On CPU the torch
path runs (``--kernels on`` needs ``TRITON_INTERPRET=1`` there, and is only for debugging).

Run: ``deltastream bench selection [--rows N] [--dim D] [--fraction F] [--table KIND]
[--device cpu|cuda] [--kernels auto|on|off]``.
"""

from __future__ import annotations

import argparse
import logging
import statistics

import torch

from bench._common import add_threads_flag, best_time, result, torch_threads

__all__ = ["main"]

log = logging.getLogger(__name__)


def _build_table(kind: str, ids: torch.Tensor, rows: torch.Tensor, device: str):
    if kind == "embedding":
        emb = torch.nn.Embedding(rows.shape[0], rows.shape[1], device=device)
        with torch.no_grad():
            emb.weight.copy_(rows)
        return emb
    from deltastream.embedding.hashtable import HashTable

    table = HashTable(rows.shape[1], name="bench", device=device,
                      capacity=int(rows.shape[0] * 1.25))
    table.insert(ids, rows)
    return table


def main(argv: list[str] | None = None) -> list[dict]:
    """Time select_changed against the copy floor (paired runs); return the result records."""
    p = argparse.ArgumentParser(prog="deltastream bench selection", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000, help="candidate rows (default 1M)")
    p.add_argument("--dim", type=int, default=128, help="row width (default 128)")
    p.add_argument("--fraction", type=float, default=0.1, help="fraction selected (0.1)")
    p.add_argument("--table", choices=["hashtable", "embedding"], default="hashtable",
                   help="table the current rows are read from (default hashtable)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu or cuda (default cuda when available)")
    p.add_argument("--kernels", choices=["auto", "on", "off"], default="auto",
                   help="select_changed's Triton kernel path (default auto: on for CUDA)")
    p.add_argument("--repeat", type=int, default=5, help="timed runs (median is reported)")
    p.add_argument("--seed", type=int, default=0)
    add_threads_flag(p, default=0)  # 0: torch's own setting, as before the shared flag
    args = p.parse_args(argv)
    if args.rows <= 0 or args.dim <= 0 or not 0 < args.fraction <= 1 or args.repeat <= 0:
        p.error("--rows, --dim, --repeat must be positive and --fraction in (0, 1]")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        p.error(f"--device: expected cpu or cuda, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device} requested but CUDA is not available here "
                "(torch.cuda.is_available() is False); run with --device cpu")
    with torch_threads(args.threads):
        return _run(args)


def _run(args: argparse.Namespace) -> list[dict]:
    from deltastream.kernels.runtime import kernels_mode, use_kernels
    from deltastream.publishing.selection import select_changed
    from deltastream.types import DeltaRows

    dev = torch.device(args.device)
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    n, dim = args.rows, args.dim
    if args.table == "embedding":
        ids = torch.arange(n, dtype=torch.int64)
    else:
        # sparse global ids, ascending, as the tracker hands them over
        ids = torch.sort(torch.randperm(n * 8, generator=g)[:n]).values * 3 + 1
    first = torch.randn(n, dim, generator=g)
    # drift ~ lognormal per row: a realistic spread of small and large changes
    drift = torch.randn(n, generator=g).exp_() * 0.01
    cur = first + torch.randn(n, dim, generator=g) * drift[:, None]
    new = torch.rand(n, generator=g) < 0.01
    age = torch.randint(0, 4, (n,), generator=g)
    ids, first, cur, new, age = (t.to(dev) for t in (ids, first, cur, new, age))
    table = _build_table(args.table, ids, cur, args.device)
    delta = DeltaRows(ids=ids, states=first, new=new, age=age)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def floor():
        torch.cat([cur, first])
        sync()

    out = {}

    def ours():
        out["sel"] = select_changed(delta, table, fraction=args.fraction)
        sync()

    def torch_path():
        with kernels_mode("off"):
            select_changed(delta, table, fraction=args.fraction)
        sync()

    # Warm up both, then alternate them so that each pair sees the same machine load (the
    # machines are shared and noisy); the figure is the median over pairs.
    with kernels_mode(args.kernels):
        kernels = use_kernels(ids)
        best_time(floor, repeat=1, warmup=0)
        best_time(ours, repeat=1, warmup=0)  # on the kernel path: compiles the kernels
        t_floor, t_ours = [], []
        for _ in range(args.repeat):
            t_floor.append(best_time(floor, repeat=1, warmup=0))
            t_ours.append(best_time(ours, repeat=1, warmup=0))
        extra = {}
        if kernels and dev.type == "cuda":
            extra["torch_path_ms"] = best_time(torch_path, repeat=3, warmup=1) * 1e3
    ratio = statistics.median(f / o for f, o in zip(t_floor, t_ours, strict=True))
    t_floor, t_ours = statistics.median(t_floor), statistics.median(t_ours)
    sel = out["sel"]
    k = len(sel)
    if k == 0:
        raise RuntimeError("selection picked no rows; benchmark setup is broken")
    read_bytes = 2 * n * dim * cur.element_size()
    name = f"selection top{args.fraction:g} {n}x{dim} {args.table} {dev.type}"
    if kernels:
        name += " kernels"
    return [
        result(name, t_ours * 1e3, t_floor * 1e3, 0.4, "ms", ratio=ratio,
               higher_is_better=True, threads=torch.get_num_threads(), selected=k, leftover=len(sel.leftover),
               floor="torch.cat(current rows, FIRST states)",
               ours_GBps=read_bytes / t_ours / 1e9, floor_GBps=read_bytes / t_floor / 1e9,
               path="kernels" if kernels else "torch", **extra),
    ]
