"""The demo's configuration: :class:`DemoOptions`, its checks and its command-line flags.

``deltastream demo`` and ``python -m deltastream_demo.run`` add the flags with :func:`add_demo_arguments`
and turn the parsed namespace into options with :func:`options_from_args`;
:meth:`DemoOptions.validate` names the first bad option and what was expected. Torch-free
(``--device cuda`` imports torch only to check the GPUs).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from deltastream.cliargs import (
    DEFAULT_MODEL,
    EnvArgumentParser,
    add_field_flags,
    add_kafka_arguments,
    field_values,
    fields_doc,
    option,
)
from deltastream.kafka_config import check_bootstrap_servers
from deltastream_demo.data import StreamConfig

__all__ = ["DemoOptions", "add_demo_arguments", "options_from_args", "DEFAULT_STEPS",
           "DEFAULT_BUDGET", "DEFAULT_BATCH", "DEFAULT_DENSE_EVERY", "WIRE_DTYPES",
           "SHARDINGS", "MODEL_KINDS"]

DEFAULT_STEPS = 2400
#: examples per worker per step by --device. A GPU step of 512 examples pays mostly for
#: kernel launches and host syncs (BENCHMARKS.md, stop 57, an H200: the demo's step took
#: 13 ms at 512, the bench's 3.4-5 ms at 4,096), so CUDA's default is a GPU trainer's batch
DEFAULT_BATCH = {"cpu": 512, "cuda": 8192}
#: bytes/s per trainer of the byte-budgeted publisher (``bench freshness-per-byte``: the most
#: serving AUC per byte); 0 = fixed rounds (``--topk-fraction`` every ``--publish-every``, by
#: a RoundPublisher)
DEFAULT_BUDGET = 50_000.0
#: steps between dense (MLP) versions: half of --eval-every's default, so a progressive
#: evaluation scores with an MLP about 50 steps old. Adam changes every tensor every step,
#: so every version is the whole MLP (~35 KB in f32 at the default sizes): on 2 cores
#: ``make demo`` sent 49 versions, 1.66 MiB in 57 s (~30 KB/s from one trainer), on top of
#: the rows' budget (not charged to it)
DEFAULT_DENSE_EVERY = 50
WIRE_DTYPES = ("f32", "f16", "bf16", "i8")
SHARDINGS = ("row", "table", "column")
MODEL_KINDS = ("hashtable", "torchrec")
DEVICES = ("cpu", "cuda")
#: the choices of --prefetch and --progress
SWITCHES = ("auto", "on", "off")


@dataclass
class DemoOptions:
    """Everything ``deltastream demo`` is configured with. Each field is spelled once, here:
    its default, its help and its flag (:func:`deltastream.cliargs.option`);
    :func:`add_demo_arguments` and :func:`options_from_args` are made from them."""

    bootstrap_servers: Optional[str] = option(
        None, "Kafka bootstrap servers (the shared --bootstrap-servers flag); None starts an "
              "embedded broker.")
    kafka_config: Optional[str] = option(None, "The shared --kafka-config FILE.")
    kafka: dict = option(help="Resolved security settings (validated).", factory=dict)
    topic: Optional[str] = option(None, "deltas topic (default deltas.<model>)", flag={})
    model_name: str = option(DEFAULT_MODEL, "model name carried in every message",
                             flag={"name": "--model"})
    workers: int = option(2, "trainer processes (torch.distributed; one shard and partition "
                             "each)", flag={"type": int})
    device: str = option("cpu", "trainer device; cuda uses nccl and one GPU per worker",
                         flag={"choices": list(DEVICES)})
    steps: Optional[int] = option(
        None, f"training steps (default {DEFAULT_STEPS}, or unbounded when only --duration "
              "is given)", flag={"type": int})
    duration: Optional[float] = option(
        None, "stop training after this many seconds (with --steps: whichever comes first)",
        flag={"type": float})
    batch_size: Optional[int] = option(
        None, f"examples per worker per step (default {DEFAULT_BATCH['cpu']} on CPU, "
              f"{DEFAULT_BATCH['cuda']} on CUDA)", flag={"type": int})
    prefetch: str = option(
        "auto", "make each worker's next batch on a thread while a step trains: auto = on "
                "CUDA only (on a 2-core CPU it sped 8,192-example steps and slowed "
                "512-example ones)", flag={"choices": list(SWITCHES)})
    publish_every: int = option(10, "steps between publish rounds (tracker consumer "
                                    "'publish')", flag={"type": int})
    snapshot_every: int = option(500, "steps between base snapshots (tracker consumer "
                                      "'snapshot')", flag={"type": int})
    eval_every: int = option(
        100, "steps between progressive evaluations during training: the trainer and the "
             "predictor's serving tables score the same next --eval-examples of the stream "
             "(AUC over the run; 0 = only the final held-out score)", flag={"type": int})
    eval_examples: int = option(4096, "examples per progressive evaluation",
                                flag={"type": int})
    topk_fraction: float = option(
        0.25, "fraction of the changed rows published per round (top by drift, new rows "
              "first; the rest is carried to the next round); 1 = all", flag={"type": float})
    publish_budget: float = option(
        DEFAULT_BUDGET, "bytes/s per trainer: publish every step the rows with the most "
                        "serving error per byte within this budget "
                        "(deltastream.BudgetPublisher); 0 = rounds of --topk-fraction every "
                        "--publish-every steps", flag={"type": float})
    dense_every: int = option(
        DEFAULT_DENSE_EVERY, "steps between dense versions: rank 0 publishes the MLP "
                             "(deltastream.DensePublisher, f32, a full version every 10) and "
                             "the predictor scores with the newest one it has assembled",
        flag={"type": int})
    dim: int = option(32, "embedding width", flag={"type": int})
    wire_dtype: str = option("f16", "row dtype on the wire", flag={"choices": list(WIRE_DTYPES)})
    max_message_bytes: int = option(1 << 20, "largest Kafka message the publisher sends "
                                             "(bytes)", flag={"type": int})
    users: int = option(50_000, "distinct users in the synthetic stream", flag={"type": int})
    items: int = option(10_000, "distinct items in the synthetic stream", flag={"type": int})
    lr_sparse: float = option(0.05, "row-wise Adagrad learning rate", flag={"type": float})
    lr_dense: float = option(2e-3, "Adam learning rate of the MLP", flag={"type": float})
    held_out: int = option(
        20_000, "examples of the held-out slice (the stream right after training) scored at "
                "the end", flag={"type": int})
    out: str = option("demo-out", "output directory: report.json, plots, snapshots, state",
                      flag={})
    seed: int = option(0, "seed of the stream and the model", flag={"type": int})
    progress: str = option("auto", "live progress line: auto = only when stderr is a "
                                   "terminal", flag={"choices": list(SWITCHES)})
    timeout: float = option(900.0, "abort the demo when it runs longer than this many "
                                   "seconds", flag={"type": float})
    log_level: str = option("WARNING", "Logging level of the demo (the shared --log-level).")
    verbose: bool = option(False, "Also the Kafka client's own log lines (the shared -v).")
    hidden: tuple = option((64, 32), "Widths of the CTR model's hidden layers.")
    sharding: str = option(
        "row", "how the user/item tables are split over the workers: row = by id slice "
               "(each worker owns some rows), table = each table whole on one worker, "
               "column = each worker holds a column range of every row",
        flag={"choices": list(SHARDINGS)})
    model_kind: str = option(
        "hashtable", "the trainers' embedding tables: hashtable = deltastream's HashTables "
                     "(any int64 id); torchrec = a TorchRec EmbeddingBagCollection sharded "
                     "row-wise by DistributedModelParallel, fused EXACT_ROWWISE_ADAGRAD "
                     "(ids 0..--users/--items; needs --sharding row and the TorchRec extra)",
        flag={"choices": list(MODEL_KINDS)})

    @property
    def resolved_topic(self) -> str:
        return self.topic or f"deltas.{self.model_name}"

    @property
    def resolved_steps(self) -> Optional[int]:
        """Step limit: ``steps``; unbounded with only ``duration``; else the default."""
        if self.steps is not None:
            return self.steps
        return None if self.duration is not None else DEFAULT_STEPS

    @property
    def resolved_batch_size(self) -> int:
        """Examples per worker per step: ``batch_size``, else the device's default."""
        return self.batch_size if self.batch_size is not None else DEFAULT_BATCH[self.device]

    @property
    def resolved_prefetch(self) -> bool:
        """Whether the trainers make their next batch on a thread (``prefetch``)."""
        return self.prefetch == "on" or (self.prefetch == "auto" and self.device == "cuda")

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad option and what was expected."""
        def pos_int(name: str, lo: int = 1, hi: int = 1 << 40) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer in "
                                 f"[{lo}, {hi}], got {v!r}")

        def one_of(name: str, choices: tuple) -> None:
            v = getattr(self, name)
            if v not in choices:
                raise ValueError(f"--{name.replace('_', '-')} must be one of {choices}, "
                                 f"got {v!r}")

        pos_int("workers", 1, 64)
        if self.steps is not None:
            pos_int("steps")
        if self.duration is not None and not (math.isfinite(self.duration)
                                              and self.duration > 0):
            raise ValueError(f"--duration must be a positive number of seconds, got "
                             f"{self.duration!r}")
        if self.batch_size is not None:
            pos_int("batch_size", 1, 1 << 20)
        pos_int("publish_every")
        pos_int("snapshot_every")
        pos_int("eval_every", 0)
        pos_int("eval_examples", 100, 1 << 22)
        if not (isinstance(self.topk_fraction, (int, float)) and 0 < self.topk_fraction <= 1):
            raise ValueError(f"--topk-fraction must be in (0, 1], got {self.topk_fraction!r}")
        b = self.publish_budget
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not (math.isfinite(b)
                                                                          and b >= 0):
            raise ValueError(f"--publish-budget must be a finite number of bytes/s >= 0 "
                             f"(0 = rounds of --topk-fraction), got {b!r}")
        pos_int("dense_every")
        pos_int("dim", 1, 4096)
        one_of("wire_dtype", WIRE_DTYPES)
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
        one_of("sharding", SHARDINGS)
        if self.sharding == "column" and self.dim < self.workers:
            raise ValueError(f"--sharding column splits --dim {self.dim} over --workers "
                             f"{self.workers}: needs dim >= workers")
        one_of("model_kind", MODEL_KINDS)
        if self.model_kind == "torchrec":
            _check_torchrec(self.sharding)
        one_of("device", DEVICES)
        one_of("prefetch", SWITCHES)
        one_of("progress", SWITCHES)
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
        return StreamConfig(seed=self.seed, n_users=self.users, n_items=self.items,
                            dense_ids=self.model_kind == "torchrec")


def _check_torchrec(sharding: str) -> None:
    """``--model-kind torchrec`` needs TorchRec and fbgemm installed (found without importing
    them: the parent process never imports torch) and row sharding."""
    import importlib.util

    for mod in ("torchrec", "fbgemm_gpu"):
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ValueError(f"--model-kind torchrec needs TorchRec: {mod!r} is not installed "
                             "(pip install 'deltastream[torchrec]', then pip install "
                             "--no-deps torchrec==1.8.0; see the README's TorchRec section)")
    if sharding != "row":
        raise ValueError(f"--model-kind torchrec shards the tables row-wise: it needs "
                         f"--sharding row, got {sharding!r}")


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
    ``DELTASTREAM_DEMO_``: each flag also reads ``DELTASTREAM_DEMO_<FLAG>``): the shared
    Kafka flags, then one per :class:`DemoOptions` field that has one."""
    add_kafka_arguments(parser, required=False,
                        help_suffix=" Without it the demo starts an embedded broker.")
    add_field_flags(parser, DemoOptions)


def options_from_args(args: argparse.Namespace) -> DemoOptions:
    """:class:`DemoOptions` from the flags of :func:`add_demo_arguments` (not validated)."""
    return DemoOptions(
        bootstrap_servers=args.bootstrap_servers, kafka_config=args.kafka_config,
        log_level=getattr(args, "log_level", "WARNING") or "WARNING",
        verbose=bool(getattr(args, "verbose", False)), **field_values(args, DemoOptions))


DemoOptions.__doc__ = (DemoOptions.__doc__ or "") + fields_doc(DemoOptions)
