"""The demo's configuration: :class:`DemoOptions`, its checks and its command-line flags.

``deltastream demo`` and ``python -m deltastream_demo.run`` add the flags with :func:`add_demo_arguments`
and turn the parsed namespace into options with :func:`options_from_args`;
:meth:`DemoOptions.validate` names the first bad option and what was expected. Torch-free
(``--device cuda`` imports torch only to check the GPUs).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from deltastream.cliargs import EnvArgumentParser, add_kafka_arguments
from deltastream.kafka_config import check_bootstrap_servers
from deltastream_demo.data import StreamConfig

__all__ = ["DemoOptions", "add_demo_arguments", "options_from_args", "DEFAULT_STEPS",
           "DEFAULT_BUDGET", "WIRE_DTYPES", "SHARDINGS"]

DEFAULT_STEPS = 2400
#: bytes/s per trainer of the byte-budgeted publisher (``bench freshness-per-byte``: the most
#: serving AUC per byte); 0 = fixed rounds (``--topk-fraction`` every ``--publish-every``)
DEFAULT_BUDGET = 50_000.0
WIRE_DTYPES = ("f32", "f16", "bf16", "i8")
SHARDINGS = ("row", "table", "column")


@dataclass
class DemoOptions:
    """Everything ``deltastream demo`` is configured with (see ``--help`` for each)."""

    bootstrap_servers: Optional[str] = None
    kafka_config: Optional[str] = None  # --kafka-config FILE
    kafka: dict = field(default_factory=dict)  # resolved security settings (validated)
    topic: Optional[str] = None
    model_name: str = "demo"
    workers: int = 2
    device: str = "cpu"
    steps: Optional[int] = None
    duration: Optional[float] = None
    batch_size: int = 512
    publish_every: int = 10
    snapshot_every: int = 500
    topk_fraction: float = 0.25
    publish_budget: float = DEFAULT_BUDGET
    dim: int = 32
    wire_dtype: str = "f16"
    max_message_bytes: int = 1 << 20
    users: int = 50_000
    items: int = 10_000
    lr_sparse: float = 0.05
    lr_dense: float = 2e-3
    held_out: int = 20_000
    out: str = "demo-out"
    seed: int = 0
    progress: str = "auto"
    timeout: float = 900.0
    log_level: str = "WARNING"
    verbose: bool = False
    hidden: tuple = field(default=(64, 32))
    sharding: str = "row"

    @property
    def resolved_topic(self) -> str:
        return self.topic or f"deltas.{self.model_name}"

    @property
    def resolved_steps(self) -> Optional[int]:
        """Step limit: ``steps``; unbounded with only ``duration``; else the default."""
        if self.steps is not None:
            return self.steps
        return None if self.duration is not None else DEFAULT_STEPS

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad option and what was expected."""
        def pos_int(name: str, lo: int = 1, hi: int = 1 << 40) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer in "
                                 f"[{lo}, {hi}], got {v!r}")

        pos_int("workers", 1, 64)
        if self.steps is not None:
            pos_int("steps")
        if self.duration is not None and not (math.isfinite(self.duration)
                                              and self.duration > 0):
            raise ValueError(f"--duration must be a positive number of seconds, got "
                             f"{self.duration!r}")
        pos_int("batch_size", 1, 1 << 20)
        pos_int("publish_every")
        pos_int("snapshot_every")
        if not (isinstance(self.topk_fraction, (int, float)) and 0 < self.topk_fraction <= 1):
            raise ValueError(f"--topk-fraction must be in (0, 1], got {self.topk_fraction!r}")
        b = self.publish_budget
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not (math.isfinite(b)
                                                                          and b >= 0):
            raise ValueError(f"--publish-budget must be a finite number of bytes/s >= 0 "
                             f"(0 = rounds of --topk-fraction), got {b!r}")
        pos_int("dim", 1, 4096)
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"--wire-dtype must be one of {WIRE_DTYPES}, got "
                             f"{self.wire_dtype!r}")
        pos_int("max_message_bytes", 4096, 1 << 30)
        from deltastream.wire import row_bytes

        one_row = row_bytes(self.dim, self.wire_dtype)
        if self.max_message_bytes < one_row + 1024:
            raise ValueError(f"--max-message-bytes {self.max_message_bytes} cannot hold one "
                             f"row of --dim {self.dim} in {self.wire_dtype} ({one_row} bytes) "
                             "plus message overhead (~1 KiB); raise it or lower --dim")
        pos_int("users", 2, 1 << 31)
        pos_int("items", 2, 1 << 31)
        for name in ("lr_sparse", "lr_dense"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number, "
                                 f"got {v!r}")
        pos_int("held_out", 100, 1 << 26)
        pos_int("seed", 0, (1 << 63) - 1)
        if self.sharding not in SHARDINGS:
            raise ValueError(f"--sharding must be one of {SHARDINGS}, got {self.sharding!r}")
        if self.sharding == "column" and self.dim < self.workers:
            raise ValueError(f"--sharding column splits --dim {self.dim} over --workers "
                             f"{self.workers}: needs dim >= workers")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.progress not in ("auto", "on", "off"):
            raise ValueError(f"--progress must be auto, on or off, got {self.progress!r}")
        if not (isinstance(self.timeout, (int, float)) and self.timeout > 0):
            raise ValueError(f"--timeout must be positive seconds, got {self.timeout!r}")
        if not self.model_name or "/" in self.model_name:
            raise ValueError(f"--model must be non-empty without '/', got "
                             f"{self.model_name!r}")
        if self.bootstrap_servers is not None:
            check_bootstrap_servers(self.bootstrap_servers)
        elif self.kafka:
            raise ValueError("Kafka security settings (--kafka-config, DELTASTREAM_KAFKA_*) "
                             "need --bootstrap-servers: the embedded broker is plaintext")
        out = Path(self.out)
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {self.out!r} exists and is not a directory")
        if self.device == "cuda":
            _check_cuda(self.workers)

    def stream_config(self) -> StreamConfig:
        return StreamConfig(seed=self.seed, n_users=self.users, n_items=self.items)


def _check_cuda(workers: int) -> None:
    try:
        import torch  # only for this check: the parent process otherwise never needs torch
    except ImportError:
        raise ValueError("--device cuda needs torch with CUDA support") from None
    if not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available (torch.cuda.is_available() "
                         "is False); use --device cpu")
    n = torch.cuda.device_count()
    if workers > n:
        raise ValueError(f"--device cuda: nccl needs one GPU per worker, but --workers {workers} "
                         f"> {n} GPUs; lower --workers")


def add_demo_arguments(parser: EnvArgumentParser) -> None:
    """Add the demo's flags to ``parser`` (an ``EnvArgumentParser`` with the prefix
    ``DELTASTREAM_DEMO_``: each flag also reads ``DELTASTREAM_DEMO_<FLAG>``)."""
    d = DemoOptions()
    a = parser.add_argument
    add_kafka_arguments(parser, required=False,
                        help_suffix=" Without it the demo starts an embedded broker.")
    a("--topic", default=None, help="deltas topic (default deltas.<model>)")
    a("--model", dest="model_name", default=d.model_name,
      help="model name carried in every message")
    a("--workers", type=int, default=d.workers,
      help="trainer processes (torch.distributed; one shard and partition each)")
    a("--device", choices=["cpu", "cuda"], default=d.device,
      help="trainer device; cuda uses nccl and one GPU per worker")
    a("--steps", type=int, default=None,
      help=f"training steps (default {DEFAULT_STEPS}, or unbounded when only --duration is "
           "given)")
    a("--duration", type=float, default=None,
      help="stop training after this many seconds (with --steps: whichever comes first)")
    a("--batch-size", type=int, default=d.batch_size, help="examples per worker per step")
    a("--publish-every", type=int, default=d.publish_every,
      help="steps between publish rounds (tracker consumer 'publish')")
    a("--snapshot-every", type=int, default=d.snapshot_every,
      help="steps between base snapshots (tracker consumer 'snapshot')")
    a("--topk-fraction", type=float, default=d.topk_fraction,
      help="fraction of the changed rows published per round (top by drift, new rows first; "
           "the rest is carried to the next round); 1 = all")
    a("--publish-budget", type=float, default=d.publish_budget,
      help="bytes/s per trainer: publish every step the rows with the most serving error per "
           "byte within this budget (deltastream.BudgetPublisher); 0 = rounds of "
           "--topk-fraction every --publish-every steps")
    a("--dim", type=int, default=d.dim, help="embedding width")
    a("--wire-dtype", choices=list(WIRE_DTYPES), default=d.wire_dtype,
      help="row dtype on the wire")
    a("--max-message-bytes", type=int, default=d.max_message_bytes,
      help="largest Kafka message the publisher sends (bytes)")
    a("--users", type=int, default=d.users, help="distinct users in the synthetic stream")
    a("--items", type=int, default=d.items, help="distinct items in the synthetic stream")
    a("--lr-sparse", type=float, default=d.lr_sparse, help="row-wise Adagrad learning rate")
    a("--lr-dense", type=float, default=d.lr_dense, help="Adam learning rate of the MLP")
    a("--held-out", type=int, default=d.held_out,
      help="examples of the held-out slice (the stream right after training) scored at the end")
    a("--out", default=d.out, help="output directory: report.json, plots, snapshots, state")
    a("--seed", type=int, default=d.seed, help="seed of the stream and the model")
    a("--progress", choices=["auto", "on", "off"], default=d.progress,
      help="live progress line: auto = only when stderr is a terminal")
    a("--sharding", choices=list(SHARDINGS), default=d.sharding,
      help="how the user/item tables are split over the workers: row = by id slice (each "
           "worker owns some rows), table = each table whole on one worker, column = each "
           "worker holds a column range of every row")
    a("--timeout", type=float, default=d.timeout,
      help="abort the demo when it runs longer than this many seconds")


def options_from_args(args: argparse.Namespace) -> DemoOptions:
    """:class:`DemoOptions` from the flags of :func:`add_demo_arguments` (not validated)."""
    return DemoOptions(
        bootstrap_servers=args.bootstrap_servers, kafka_config=args.kafka_config,
        topic=args.topic,
        model_name=args.model_name, workers=args.workers, device=args.device,
        steps=args.steps, duration=args.duration, batch_size=args.batch_size,
        publish_every=args.publish_every, snapshot_every=args.snapshot_every,
        topk_fraction=args.topk_fraction, publish_budget=args.publish_budget, dim=args.dim, wire_dtype=args.wire_dtype,
        max_message_bytes=args.max_message_bytes, users=args.users, items=args.items,
        lr_sparse=args.lr_sparse, lr_dense=args.lr_dense, held_out=args.held_out,
        out=args.out, seed=args.seed, progress=args.progress, timeout=args.timeout,
        log_level=getattr(args, "log_level", "WARNING") or "WARNING",
        verbose=bool(getattr(args, "verbose", False)),
        sharding=getattr(args, "sharding", "row") or "row")
