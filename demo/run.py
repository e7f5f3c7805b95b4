"""``deltastream demo``: train a small CTR model online and stream its deltas to a predictor.

The whole job on one machine, with real processes::

    parent (this module; no torch)
      ├─ embedded broker (Tansu)            unless --bootstrap-servers names a Kafka
      ├─ trainer 0 … W-1 (torch)            demo.trainer: ShardedEmbedding over
      │                                     gloo (nccl with --device cuda), DeltaTracker,
      │                                     select_changed, DeltaPublisher, base snapshots
      └─ predictor (no torch)               demo.predictor: SyncDaemon, then
                                            scoring with serving vs trainer tables

The parent starts the processes, shows live progress on a terminal (step, loss, examples/s,
rows published/s, lag, freshness p99), and at the end writes ``report.json`` and PNG plots to
``--out`` and prints the report table. It exits 0 when every invariant of the report holds
(:func:`demo.report.check_report`), 1 when one is broken, 2 on bad flags.

Defaults finish in about a minute on a 2-core machine; ``--steps`` / ``--duration`` scale
the run up. Everything is seeded (``--seed``): the stream, the model's initialization and
therefore the training trajectory are reproducible (timings and freshness are not).
"""

from __future__ import annotations

import argparse
import logging
import math
import multiprocessing as mp
import queue
import shutil
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, TextIO

from deltastream.broker import BrokerError, EmbeddedBroker, free_port
from demo import report as rpt
from demo.data import StreamConfig

__all__ = ["DemoOptions", "DemoError", "add_demo_arguments", "run_demo_cli", "run_demo",
           "DEFAULT_STEPS"]

log = logging.getLogger(__name__)

DEFAULT_STEPS = 2400
_WIRE_DTYPES = ("f32", "f16", "bf16", "i8")


class DemoError(RuntimeError):
    """The demo could not run to the end (a process failed, a timeout); the text says why."""


@dataclass
class DemoOptions:
    """Everything ``deltastream demo`` is configured with (see ``--help`` for each)."""

    bootstrap_servers: Optional[str] = None
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
    hidden: tuple = field(default=(64, 32))

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
        pos_int("dim", 1, 4096)
        if self.wire_dtype not in _WIRE_DTYPES:
            raise ValueError(f"--wire-dtype must be one of {_WIRE_DTYPES}, got "
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
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.progress not in ("auto", "on", "off"):
            raise ValueError(f"--progress must be auto, on or off, got {self.progress!r}")
        if not (isinstance(self.timeout, (int, float)) and self.timeout > 0):
            raise ValueError(f"--timeout must be positive seconds, got {self.timeout!r}")
        if not self.model_name or "/" in self.model_name:
            raise ValueError(f"--model must be non-empty without '/', got "
                             f"{self.model_name!r}")
        if self.bootstrap_servers is not None and not self.bootstrap_servers.strip():
            raise ValueError("--bootstrap-servers must be host:port[,host:port] when given")
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


# --------------------------------------------------------------------------- CLI


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's flags to ``parser`` (an ``EnvArgumentParser``: DELTASTREAM_* defaults)."""
    d = DemoOptions()
    a = parser.add_argument
    a("--bootstrap-servers", default=None,
      help="Kafka bootstrap servers host:port[,host:port]; none = start an embedded broker")
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
    a("--dim", type=int, default=d.dim, help="embedding width")
    a("--wire-dtype", choices=list(_WIRE_DTYPES), default=d.wire_dtype,
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
    a("--timeout", type=float, default=d.timeout,
      help="abort the demo when it runs longer than this many seconds")


def run_demo_cli(args: argparse.Namespace) -> int:
    """Run the demo from parsed CLI ``args``; print the report. Exit code (0/1/2)."""
    try:
        opts = DemoOptions(
            bootstrap_servers=args.bootstrap_servers, topic=args.topic,
            model_name=args.model_name, workers=args.workers, device=args.device,
            steps=args.steps, duration=args.duration, batch_size=args.batch_size,
            publish_every=args.publish_every, snapshot_every=args.snapshot_every,
            topk_fraction=args.topk_fraction, dim=args.dim, wire_dtype=args.wire_dtype,
            max_message_bytes=args.max_message_bytes, users=args.users, items=args.items,
            lr_sparse=args.lr_sparse, lr_dense=args.lr_dense, held_out=args.held_out,
            out=args.out, seed=args.seed, progress=args.progress, timeout=args.timeout,
            log_level=getattr(args, "log_level", "WARNING") or "WARNING")
        opts.validate()
    except ValueError as e:
        print(f"deltastream demo: error: {e}", file=sys.stderr)
        return 2
    if opts.log_level != "DEBUG":
        # kafka-python logs every connection at INFO; the demo's own progress says enough
        logging.getLogger("kafka").setLevel(logging.WARNING)
    try:
        report = run_demo(opts)
    except DemoError as e:
        print(f"deltastream demo: failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("deltastream demo: interrupted", file=sys.stderr)
        return 130
    print(rpt.format_report(report))
    print(f"\nreport: {Path(opts.out) / 'report.json'}")
    return 0 if not report["invariants"]["problems"] else 1


# --------------------------------------------------------------------------- progress


class _Progress:
    """A single updating status line on a terminal (nothing when disabled)."""

    def __init__(self, stream: TextIO, enabled: bool) -> None:
        self.stream = stream
        self.enabled = enabled
        self._last = 0.0
        self._width = 0

    def update(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last < 0.2):
            return
        self._last = now
        pad = max(0, self._width - len(text))
        self._width = len(text)
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0


def _fmt_rate(x: float) -> str:
    return f"{x / 1e3:.1f}K" if x >= 1e3 else f"{x:.0f}"


# --------------------------------------------------------------------------- orchestration


def _stop_process(p: mp.process.BaseProcess, grace: float = 5.0) -> None:
    """Wait for ``p`` briefly, then terminate, then kill it (only this demo's children)."""
    if p.pid is None:
        return
    p.join(timeout=grace)
    if p.is_alive():
        p.terminate()
        p.join(timeout=5.0)
    if p.is_alive():
        p.kill()
        p.join(timeout=5.0)


class _Run:
    """State of one demo run in the parent: processes, events and what they reported."""

    def __init__(self, opts: DemoOptions, progress: _Progress) -> None:
        self.opts = opts
        self.progress = progress
        self.ctx = mp.get_context("spawn")
        self.events = self.ctx.Queue()
        self.control = self.ctx.Queue()
        self.procs: dict[str, mp.process.BaseProcess] = {}
        self.finals: dict[int, dict] = {}
        self.result: Optional[dict] = None
        self.ready: set[str] = set()
        self.train: dict = {}
        self.serve: dict = {}
        self.pub_events: list[tuple[float, int]] = []  # (wall time, rows)
        self.train_hist: list[tuple[float, int]] = []  # (wall time, examples so far)
        self.t_start = time.monotonic()

    def check_children(self) -> None:
        for name, p in self.procs.items():
            code = p.exitcode
            if code not in (None, 0):
                raise DemoError(f"{name} exited with code {code} (see its log above)")

    def handle(self, ev: dict) -> None:
        kind = ev.get("kind")
        if kind == "error":
            raise DemoError(f"{ev.get('who')}: {ev.get('error')}")
        if kind == "ready":
            self.ready.add(ev["who"])
        elif kind == "train":
            self.train = ev
            self.train_hist.append((time.time(), int(ev["examples"])))
        elif kind == "serve":
            self.serve = ev
        elif kind == "publish":
            self.pub_events.append((time.time(), int(ev["published"])))
        elif kind == "final":
            self.finals[int(ev["rank"])] = ev
        elif kind == "result":
            self.result = ev

    def pump(self, until, timeout: float, what: str) -> None:
        """Handle events until ``until()`` is true; DemoError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while not until():
            if time.monotonic() > deadline:
                raise DemoError(f"timed out after {timeout:g} s waiting for {what}")
            try:
                ev = self.events.get(timeout=0.2)
            except queue.Empty:
                self.check_children()
                self.show()
                continue
            self.handle(ev)
            self.show()

    def show(self) -> None:
        o = self.opts
        tr, sv = self.train, self.serve
        now = time.time()
        recent = [r for t, r in self.pub_events if now - t <= 3.0]
        rows_s = sum(recent) / 3.0
        steps = o.resolved_steps
        elapsed = time.monotonic() - self.t_start
        if not tr:
            self.progress.update(f"[{elapsed:5.1f}s] starting broker, predictor and "
                                 f"{o.workers} trainer(s)…")
            return
        hist = [h for h in self.train_hist if now - h[0] <= 3.0]
        ex_s = ((hist[-1][1] - hist[0][1]) / (hist[-1][0] - hist[0][0])
                if len(hist) > 1 and hist[-1][0] > hist[0][0] else 0.0)
        p99 = sv.get("fresh_p99")
        phase = "training" if len(self.finals) < o.workers else "scoring"
        line = (f"[{elapsed:5.1f}s] {phase} step {tr.get('step', 0)}/"
                f"{steps if steps else '∞'}  loss {tr.get('loss', float('nan')):.4f}  "
                f"{_fmt_rate(ex_s)} ex/s  pub {_fmt_rate(rows_s)} rows/s  "
                f"lag {sv.get('lag') if sv.get('lag') is not None else '-'}  "
                f"fresh p99 {'-' if p99 is None else f'{p99 * 1e3:.0f} ms'}")
        self.progress.update(line)


def _prepare_out(out: Path) -> dict[str, Path]:
    """Create ``out`` and clear the demo's own sub-directories from an earlier run."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"work": out / "work", "state": out / "predictor-state",
             "snapshots": out / "snapshots"}
    for p in paths.values():
        if p.exists():
            shutil.rmtree(p)
        p.mkdir(parents=True)
    for name in ("report.json", "freshness.png", "published.png"):
        try:
            (out / name).unlink()
        except FileNotFoundError:
            pass
    return paths


def run_demo(opts: DemoOptions, *, progress_stream: Optional[TextIO] = None) -> dict:
    """Run the demo end to end; return the report (also written to ``opts.out``).

    Raises :class:`DemoError` when a process fails or the run exceeds ``opts.timeout``.
    """
    opts.validate()
    stream = progress_stream or sys.stderr
    enabled = opts.progress == "on" or (opts.progress == "auto" and stream.isatty())
    progress = _Progress(stream, enabled)
    out = Path(opts.out)
    paths = _prepare_out(out)
    topic = opts.resolved_topic
    child_level = "DEBUG" if opts.log_level == "DEBUG" else "WARNING"
    t0_wall = time.time()
    run = _Run(opts, progress)
    deadline = time.monotonic() + opts.timeout
    with ExitStack() as stack:
        if opts.bootstrap_servers is None:
            try:
                broker = stack.enter_context(EmbeddedBroker())
            except BrokerError as e:
                raise DemoError(str(e)) from None
            servers = broker.bootstrap_servers
            log.info("embedded broker at %s", servers)
        else:
            servers = opts.bootstrap_servers
        from deltastream.publishing.publisher import PublishError, ensure_topic

        try:
            parts = ensure_topic(servers, topic, partitions=opts.workers,
                                 max_message_bytes=opts.max_message_bytes)
        except PublishError as e:  # TopicError is one too
            raise DemoError(f"cannot use topic {topic!r} on {servers}: {e}") from None
        if parts < opts.workers:
            log.warning("topic %s has %d partitions for %d trainer shards", topic, parts,
                        opts.workers)
        stream_cfg = opts.stream_config().to_dict()
        common = dict(bootstrap_servers=servers, topic=topic, model_name=opts.model_name,
                      dim=opts.dim, wire_dtype=opts.wire_dtype, stream=stream_cfg,
                      heldout=opts.held_out, work_dir=str(paths["work"]),
                      snapshot_dir=str(paths["snapshots"]), t0=t0_wall,
                      log_level=child_level)
        pcfg = dict(common, state_dir=str(paths["state"]), progress_interval=0.5)
        predictor = run.ctx.Process(target=_predictor_entry, args=(pcfg, run.events,
                                                                   run.control),
                                    name="deltastream-predictor", daemon=False)
        predictor.start()
        run.procs["predictor"] = predictor
        stack.callback(_stop_process, predictor, 1.0)
        run.pump(lambda: "predictor" in run.ready, 60.0, "the predictor to start")

        tcfg = dict(common, world=opts.workers, master_port=free_port(), device=opts.device,
                    hidden=tuple(opts.hidden), batch_size=opts.batch_size,
                    steps=opts.resolved_steps, duration=opts.duration,
                    publish_every=opts.publish_every, snapshot_every=opts.snapshot_every,
                    topk_fraction=float(opts.topk_fraction),
                    max_message_bytes=opts.max_message_bytes, lr_sparse=opts.lr_sparse,
                    lr_dense=opts.lr_dense, seed=opts.seed, threads=1)
        for r in range(opts.workers):
            p = run.ctx.Process(target=_trainer_entry, args=(r, tcfg, run.events),
                                name=f"deltastream-trainer-{r}", daemon=False)
            p.start()
            run.procs[f"trainer {r}"] = p
            stack.callback(_stop_process, p, 1.0)
        try:
            run.pump(lambda: len(run.finals) == opts.workers,
                     max(1.0, deadline - time.monotonic()), "the trainers to finish")
            offsets: dict[int, int] = {}
            for f in run.finals.values():
                for part, off in f["offsets"].items():
                    offsets[int(part)] = max(offsets.get(int(part), 0), int(off))
            heldout_start = run.finals[0]["heldout_start"]
            run.control.put({"kind": "finish", "offsets": offsets,
                             "dumps": [run.finals[r]["dump"] for r in sorted(run.finals)],
                             "cfg": {"heldout_start": heldout_start},
                             "timeout": max(10.0, min(120.0, deadline - time.monotonic()))})
            run.pump(lambda: run.result is not None, max(1.0, deadline - time.monotonic()),
                     "the predictor's scores")
        except BaseException:
            progress.close()
            try:
                run.control.put({"kind": "abort"})
            except (OSError, ValueError):
                pass
            raise
        finally:
            for p in run.procs.values():
                p.join(timeout=0.1)
        progress.close()
        for name, p in run.procs.items():
            p.join(timeout=30.0)
            if p.exitcode not in (0, None):
                log.warning("%s exited with code %s after reporting", name, p.exitcode)
    report = build_report(opts, run.finals, run.result, topic=topic, servers=servers,
                          embedded=opts.bootstrap_servers is None,
                          wall_s=time.time() - t0_wall)
    report["plots"] = _plots(out, report, run.result)
    report["invariants"] = {"problems": rpt.check_report(report)}
    rpt.write_report(report, out)
    return report


def _predictor_entry(cfg: dict, events: Any, control: Any) -> None:
    from demo.predictor import predictor_main

    predictor_main(cfg, events, control)


def _trainer_entry(rank: int, cfg: dict, events: Any) -> None:
    from demo.trainer import trainer_main

    trainer_main(rank, cfg, events)


# --------------------------------------------------------------------------- the report


def _merge_rounds(finals: dict[int, dict]) -> list[dict]:
    """Publish rounds summed over shards, keyed by (step, final)."""
    by: dict[tuple[int, bool], dict] = {}
    for f in finals.values():
        for r in f["rounds"]:
            key = (int(r["step"]), bool(r["final"]))
            cur = by.setdefault(key, {"step": key[0], "final": key[1], "t": r["t"], "rows": 0,
                                      "bytes": 0, "messages": 0, "tracked": 0, "carried": 0})
            cur["t"] = min(cur["t"], r["t"])
            cur["rows"] += int(r["published"])
            cur["bytes"] += int(r["bytes"])
            cur["messages"] += int(r["messages"])
            cur["tracked"] += int(r["tracked"])
            cur["carried"] += int(r["carried"])
    return [by[k] for k in sorted(by, key=lambda k: (k[1], k[0]))]


def build_report(opts: DemoOptions, finals: dict[int, dict], result: dict, *, topic: str,
                 servers: str, embedded: bool, wall_s: float) -> dict:
    """The report dict (``report.json``) from the trainers' final messages and the
    predictor's result."""
    from deltastream.wire import row_bytes

    ranks = sorted(finals)
    f0 = finals[ranks[0]]
    totals = {k: sum(int(finals[r]["totals"][k]) for r in ranks)
              for k in f0["totals"]}
    train_s = max(float(finals[r]["train_seconds"]) for r in ranks)
    examples = int(f0["examples"])
    published = totals["published"]
    uniq = sum(int(v.get("ids_compared", 0)) + int(v.get("missing_in_serving", 0))
               for v in result["drift"]["tables"].values())
    rounds = _merge_rounds(finals)
    auc = dict(result["auc"])
    cfg = asdict(opts)
    cfg.update(topic=topic, bootstrap_servers=servers, embedded_broker=embedded,
               steps=opts.resolved_steps)
    boot = result.get("bootstrap") or {}
    return {
        "version": rpt.REPORT_VERSION,
        "kind": "deltastream-demo",
        "created_at": time.time(),
        "config": cfg,
        "stream": opts.stream_config().to_dict(),
        "train": {
            "steps": int(f0["steps"]), "examples": examples, "seconds": train_s,
            "examples_per_s": examples / train_s if train_s > 0 else None,
            "final_loss": f0["final_loss"], "flush_seconds": max(
                float(finals[r]["flush_seconds"]) for r in ranks),
            "wall_seconds": wall_s,
            "rows_held": {name: sum(int(finals[r]["rows_held"][name]) for r in ranks)
                          for name in f0["rows_held"]},
        },
        "rows": {
            "tracked": totals["tracked"], "published": published,
            "carried": totals["carried"], "rejected": totals["rejected"],
            "tombstones": totals["tombstones"], "final_flush": totals["final_flush"],
            "rounds": int(f0["totals"]["rounds"]), "unique_published": uniq,
            "left_after_flush": sum(int(finals[r]["left_after_flush"]) for r in ranks),
        },
        "wire": {
            "dtype": opts.wire_dtype, "messages": totals["messages"], "bytes": totals["bytes"],
            "bytes_per_row": totals["bytes"] / published if published else None,
            "row_payload_bytes": row_bytes(opts.dim, opts.wire_dtype),
            "rows_per_s": published / train_s if train_s > 0 else None,
            "full_rows_bytes": row_bytes(opts.dim, "f32") * published,
        },
        "freshness_s": result["freshness"],
        "drift": {k: v for k, v in result["drift"].items()},
        "auc": auc,
        "predictor": dict(result["stats"], torch_imported=result["torch_imported"]),
        "snapshot": {"count": int(f0["snapshots"]["count"]),
                     "last_step": f0["snapshots"]["last_step"],
                     "seconds": max(float(finals[r]["snapshots"]["seconds"]) for r in ranks),
                     "bootstrap": boot},
        "trainers": [{"rank": r, "epoch": finals[r]["epoch"], "offsets": finals[r]["offsets"],
                      "tracker": finals[r].get("tracker"),
                      "publisher": finals[r].get("publisher")} for r in ranks],
        "timeline": {
            "publish": [[r["step"], r["t"], r["rows"], r["bytes"], int(r["final"])]
                        for r in rounds],
            "freshness": [list(s) for s in rpt.freshness_series(
                result["apply_t"], result["apply_fresh"], bin_s=1.0)],
            "loss": f0.get("losses", []),
        },
    }


def _plots(out: Path, report: dict, result: dict) -> list[str]:
    made = []
    p = rpt.plot_freshness(out / "freshness.png", result["apply_t"], result["apply_fresh"],
                           bin_s=1.0)
    if p is not None:
        made.append(str(p))
    pub = report["timeline"]["publish"]  # regular rounds by step, then the final flush
    final = pub[-1][0] if pub and pub[-1][4] else None
    p = rpt.plot_published(out / "published.png", [r[0] for r in pub], [r[2] for r in pub],
                           [r[3] for r in pub], final_step=final)
    if p is not None:
        made.append(str(p))
    return made


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m demo.run [flags]``: the same as ``deltastream demo [flags]``."""
    from deltastream.cliargs import EnvArgumentParser

    p = EnvArgumentParser(prog="deltastream demo", description=__doc__.splitlines()[0])
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging level")
    add_demo_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_demo_cli(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
