"""``deltastream demo``: train a small CTR model online and stream its deltas to a predictor.

The whole job on one machine, with real processes::

    parent (this module; no torch)
      ├─ embedded broker (Tansu)            unless --bootstrap-servers names a Kafka
      ├─ trainer 0 … W-1 (torch)            deltastream_demo.trainer: ShardedEmbedding over
      │                                     gloo (nccl with --device cuda), DeltaTracker,
      │                                     a budget or round publisher, base snapshots
      └─ predictor (no torch)               deltastream_demo.predictor: SyncDaemon, then
                                            scoring with serving vs trainer tables

Options and flags are in :mod:`deltastream_demo.options`, the progress line in :mod:`deltastream_demo.progress`, the
report dict and plots in :mod:`deltastream_demo.summary` (written and checked by :mod:`deltastream_demo.report`).
The parent starts the processes, shows live progress on a terminal (step, loss, examples/s,
rows published/s, lag, freshness p99), and at the end writes ``report.json`` and PNG plots to
``--out`` and prints the report table. It exits 0 when every invariant of the report holds
(:func:`deltastream_demo.report.check_report`), 1 when one is broken or a process failed, 2 on bad flags,
3 when the broker or the topic is unavailable, 130 on Ctrl-C (the children are stopped first;
they ignore SIGINT themselves, so one Ctrl-C gives one "interrupted" line).

Defaults finish in about a minute on a 2-core machine; ``--steps`` / ``--duration`` scale
the run up. Everything is seeded (``--seed``): the stream, the model's initialization and
therefore the training trajectory are reproducible (timings and freshness are not).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import queue
import signal
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Optional, TextIO

from deltastream.broker import BrokerError, EmbeddedBroker, free_port
from deltastream.cliargs import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
)
from deltastream.clilog import hide_secrets, kafka_hint
from deltastream.kafka_config import (
    refused_everywhere,
    secret_values,
    security_config,
    tls_probe,
)
from deltastream_demo import outdir
from deltastream_demo import report as rpt
from deltastream_demo.options import (
    DEFAULT_STEPS,
    DemoOptions,
    add_demo_arguments,
    options_from_args,
)
from deltastream_demo.outdir import OutDirError
from deltastream_demo.progress import ProgressLine, status_line
from deltastream_demo.summary import build_report, make_plots

# DemoOptions, add_demo_arguments and DEFAULT_STEPS live in deltastream_demo.options; they are
# re-exported here, where ``deltastream demo`` has always found them.
__all__ = ["DemoOptions", "DemoError", "DemoUnavailable", "DemoUsageError", "add_demo_arguments",
           "run_demo_cli", "run_demo", "DEFAULT_STEPS"]

log = logging.getLogger(__name__)


class DemoError(RuntimeError):
    """The demo could not run to the end (a process failed, a timeout); the text says why."""


class DemoUsageError(DemoError):
    """The options cannot be used as given (e.g. ``--out`` holds files the demo did not
    write); the text says why."""


class DemoUnavailable(DemoError):
    """The broker (embedded or given) or the topic cannot be used; the text says why."""


# --------------------------------------------------------------------------- CLI


def run_demo_cli(args: argparse.Namespace) -> int:
    """Run the demo from parsed CLI ``args``; print the report. Exit code (see the module
    docstring)."""
    try:
        opts = options_from_args(args)
        opts.kafka = security_config(opts.kafka_config,
                                     prefixes=("DELTASTREAM_DEMO_", "DELTASTREAM_"))
        opts.validate()
    except ValueError as e:
        print(f"deltastream demo: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    hide_secrets(secret_values(opts.kafka))
    main_thread = threading.current_thread() is threading.main_thread()
    old = signal.getsignal(signal.SIGINT)
    if main_thread:
        signal.signal(signal.SIGINT, _first_interrupt)
    try:
        report = run_demo(opts)
    except DemoUsageError as e:
        print(f"deltastream demo: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except DemoUnavailable as e:
        print(f"deltastream demo: error: {e}{kafka_hint(str(e))}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except DemoError as e:
        print(f"deltastream demo: failed: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("deltastream demo: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, old)
    print(rpt.format_report(report))
    print(f"\nreport: {Path(opts.out) / 'report.json'}")
    return EXIT_OK if not report["invariants"]["problems"] else EXIT_FAILED


def _first_interrupt(signum: int, frame: Any) -> None:
    """Ctrl-C: stop the demo; a second Ctrl-C must not cut the children's cleanup short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


# --------------------------------------------------------------------------- orchestration


def _terminate_all(procs: list[mp.process.BaseProcess]) -> None:
    """SIGTERM to every child at once (none lives to report the others' death), then wait."""
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.terminate()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)


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

    def __init__(self, opts: DemoOptions, progress: ProgressLine, stack: ExitStack) -> None:
        self.opts = opts
        self.progress = progress
        self.ctx = mp.get_context("spawn")
        # Queues served by a manager process, not multiprocessing.Queue: those are backed by
        # named POSIX semaphores (3 each) that only garbage collection unlinks, and the
        # resource tracker unlinks them too when it outlives its pipe ("leaked semaphore
        # objects", then "sem_unlink … FileNotFoundError" at exit). A manager's queues use
        # none; it ignores Ctrl-C and is shut down after the children (``stack``).
        manager = stack.enter_context(self.ctx.Manager())
        self.events = manager.Queue()
        self.control = manager.Queue()
        self.procs: dict[str, mp.process.BaseProcess] = {}
        self.finals: dict[int, dict] = {}
        self.result: Optional[dict] = None
        self.evals: dict[int, dict] = {}  # step -> trainer AUC, then the serving AUC
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
        elif kind == "eval":  # the predictor scores the same examples with serving tables
            self.evals[int(ev["step"])] = {k: ev[k] for k in ("step", "t", "n", "auc")}
            self.control.put(ev)
        elif kind == "serve_eval":
            self.evals.setdefault(int(ev["step"]), {}).update(
                serving_auc=ev["auc"], serving_t=ev["t"], lag=ev["lag"],
                dense_step=ev["dense_step"], dense_age_steps=ev["dense_age_steps"],
                dense_age_s=ev["dense_age_s"])
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
        self.progress.update(status_line(
            elapsed=elapsed, phase="training" if len(self.finals) < o.workers else "scoring",
            step=tr.get("step", 0), steps=steps, loss=tr.get("loss", float("nan")),
            examples_per_s=ex_s, rows_per_s=rows_s, lag=sv.get("lag"),
            fresh_p99=sv.get("fresh_p99")))


def _broker_and_topic(stack: ExitStack, opts: DemoOptions, topic: str) -> str:
    """The bootstrap servers of the run (an embedded broker, closed with ``stack``, when
    none is given), checked usable, and the topic made; :class:`DemoUnavailable` if not."""
    if opts.bootstrap_servers is None:
        try:
            broker = stack.enter_context(EmbeddedBroker())
        except BrokerError as e:
            raise DemoUnavailable(str(e)) from None
        servers = broker.bootstrap_servers
        log.info("embedded broker at %s", servers)
    else:
        servers = opts.bootstrap_servers
    from deltastream.errors import PublishError, TopicError
    from deltastream.publishing.topics import ensure_topic

    problem = refused_everywhere(servers) or tls_probe(servers, opts.kafka, 15.0)
    if problem:
        raise DemoUnavailable(f"cannot use {servers}: {problem}")
    try:
        parts = ensure_topic(servers, topic, partitions=opts.workers,
                             max_message_bytes=opts.max_message_bytes, **opts.kafka)
    except (PublishError, TopicError) as e:
        raise DemoUnavailable(f"cannot use topic {topic!r} on {servers}: {e}") from None
    if parts < opts.workers:
        log.warning("topic %s has %d partitions for %d trainer shards", topic, parts,
                    opts.workers)
    return servers


def _trainer_config(common: dict, opts: DemoOptions) -> dict:
    """What each trainer process is given: ``common`` plus the training settings."""
    return dict(common, world=opts.workers, master_port=free_port(), device=opts.device,
                hidden=tuple(opts.hidden), batch_size=opts.resolved_batch_size,
                prefetch=opts.resolved_prefetch,
                steps=opts.resolved_steps, duration=opts.duration,
                publish_every=opts.publish_every, snapshot_every=opts.snapshot_every,
                eval_every=opts.eval_every, eval_examples=opts.eval_examples,
                dense_every=opts.dense_every,
                topk_fraction=float(opts.topk_fraction),
                publish_budget=float(opts.publish_budget),
                max_message_bytes=opts.max_message_bytes, lr_sparse=opts.lr_sparse,
                lr_dense=opts.lr_dense, seed=opts.seed, threads=1,
                sharding=opts.sharding, model_kind=opts.model_kind)


def run_demo(opts: DemoOptions, *, progress_stream: Optional[TextIO] = None) -> dict:
    """Run the demo end to end; return the report (also written to ``opts.out``).

    Raises :class:`DemoError` when a process fails or the run exceeds ``opts.timeout``.
    """
    opts.validate()
    stream = progress_stream or sys.stderr
    enabled = opts.progress == "on" or (opts.progress == "auto" and stream.isatty())
    progress = ProgressLine(stream, enabled)
    out = Path(opts.out)
    try:
        paths = outdir.prepare(out)
    except (OutDirError, OSError) as e:
        raise DemoUsageError(str(e)) from None
    try:
        return _run(opts, out, paths, progress)
    finally:
        outdir.record(out)


def _run(opts: DemoOptions, out: Path, paths: dict[str, Path],
         progress: ProgressLine) -> dict:
    """:func:`run_demo` once ``out`` is ready."""
    topic = opts.resolved_topic
    child_level = "DEBUG" if opts.log_level == "DEBUG" else "WARNING"
    t0_wall = time.time()
    deadline = time.monotonic() + opts.timeout
    with ExitStack() as stack:
        run = _Run(opts, progress, stack)
        servers = _broker_and_topic(stack, opts, topic)
        stream_cfg = opts.stream_config().to_dict()
        common = dict(bootstrap_servers=servers, topic=topic, model_name=opts.model_name,
                      dim=opts.dim, wire_dtype=opts.wire_dtype, stream=stream_cfg,
                      heldout=opts.held_out, work_dir=str(paths["work"]),
                      snapshot_dir=str(paths["snapshots"]), t0=t0_wall,
                      log_level=child_level, verbose=opts.verbose, kafka_config=opts.kafka)
        pcfg = dict(common, state_dir=str(paths["state"]), progress_interval=0.5)
        predictor = run.ctx.Process(target=_predictor_entry, args=(pcfg, run.events,
                                                                   run.control),
                                    name="deltastream-predictor", daemon=False)
        predictor.start()
        run.procs["predictor"] = predictor
        stack.callback(_stop_process, predictor, 1.0)
        run.pump(lambda: "predictor" in run.ready, 60.0, "the predictor to start")

        tcfg = _trainer_config(common, opts)
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
        except BaseException as e:
            progress.close()
            if isinstance(e, KeyboardInterrupt):  # stop now, all at once, quietly
                # (no "abort" message: the interrupted call left this thread's connection
                # to the manager mid-reply)
                _terminate_all(list(run.procs.values()))
                raise
            try:
                run.control.put({"kind": "abort"})
            except (OSError, ValueError, EOFError):  # the manager is gone too
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
                          wall_s=time.time() - t0_wall,
                          evals=[run.evals[s] for s in sorted(run.evals)])
    report["plots"] = make_plots(out, report, run.result)
    report["invariants"] = {"problems": rpt.check_report(report)}
    rpt.write_report(report, out)
    return report


def _predictor_entry(cfg: dict, events: Any, control: Any) -> None:
    from deltastream_demo.predictor import predictor_main

    predictor_main(cfg, events, control)


def _trainer_entry(rank: int, cfg: dict, events: Any) -> None:
    from deltastream_demo.trainer import trainer_main

    trainer_main(rank, cfg, events)


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m deltastream_demo.run [flags]``: the same as ``deltastream demo [flags]``."""
    from deltastream.cliargs import EXIT_CODES, EnvArgumentParser, add_logging_arguments
    from deltastream.clilog import setup_logging

    p = EnvArgumentParser(prog="deltastream demo", env_prefix="DELTASTREAM_DEMO_",
                          description=__doc__.splitlines()[0], epilog=EXIT_CODES)
    add_logging_arguments(p)
    add_demo_arguments(p)
    args = p.parse_args(argv)
    setup_logging(args.log_level, verbose=args.verbose)
    return run_demo_cli(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
