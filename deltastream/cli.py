"""The deltastream command: demo, bench, topic and broker subcommands.

Each subcommand reads its flags also from DELTASTREAM_<SUBCOMMAND>_<FLAG> variables
(``DELTASTREAM_TOPIC_PARTITIONS``, ``DELTASTREAM_DEMO_STEPS``, …); the shared settings
from ``DELTASTREAM_BOOTSTRAP_SERVERS``, ``DELTASTREAM_KAFKA_*`` and
``DELTASTREAM_LOG_LEVEL`` (see :mod:`deltastream.cliargs`). Exit codes follow
:data:`deltastream.cliargs.EXIT_CODES`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from deltastream.cliargs import (
    BROKER_TIMEOUT_S,
    DEFAULT_MODEL,
    EXIT_CODES,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    ONE_SHOT,
    SERVICE,
    EnvArgumentParser,
    add_kafka_arguments,
    add_logging_arguments,
    kafka_settings,
    positive_float,
    positive_int,
)
from deltastream.clilog import kafka_hint, setup_cli_logging
from deltastream.errors import DeltastreamError, error_text
from deltastream.kafka_config import refused_everywhere, secret_values, tls_probe

__all__ = ["main", "build_parser", "bench_names"]

log = logging.getLogger(__name__)

PROG = "deltastream"
#: a source checkout whose ``bench/`` ``deltastream bench`` runs (default: see _checkout)
BENCH_DIR_ENV = "DELTASTREAM_BENCH_DIR"


def _checkout() -> Optional[Path]:
    """The source checkout holding ``bench/``: ``$DELTASTREAM_BENCH_DIR``, else the one this
    package was installed from (``pip install -e .``), else the current directory; None
    when none of them is one. The benchmarks are a checkout tool: they are not installed
    with the package (a wheel has no ``bench/``)."""
    env = os.environ.get(BENCH_DIR_ENV)
    candidates = [Path(env)] if env else [Path(__file__).resolve().parent.parent, Path.cwd()]
    return next((d for d in candidates if (d / "bench" / "_common.py").is_file()), None)


def bench_names() -> list[str]:
    """Benchmarks of the checkout's ``bench/`` directory, in CLI spelling ([] without a
    checkout)."""
    root = _checkout()
    if root is None:
        return []
    return sorted(p.stem.replace("_", "-") for p in (root / "bench").glob("*.py")
                  if not p.stem.startswith("_") and p.stem != "run_all")


def _import_bench(name: str):
    """Import ``bench.<name>`` of the checkout (its root goes on ``sys.path``: the
    benchmarks import each other as ``bench.*``)."""
    root = _checkout()
    if root is None:
        raise SystemExit(f"deltastream bench: runs the benchmarks of a source checkout "
                         f"(bench/ is not installed with the package); run it inside one, "
                         f"or set {BENCH_DIR_ENV} to its path")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(f"bench.{name.replace('-', '_')}")


def _cmd_bench(args: argparse.Namespace) -> int:
    names = bench_names()
    if args.name == "list":
        print("\n".join(names))
        return EXIT_OK
    common = _import_bench("_common")
    if args.name == "all":
        runner = _import_bench("run_all")
        # flags after "all" land in bench_args (REMAINDER); run_all parses them itself
        return runner.main(list(args.bench_args) + (["--write", args.write] if args.write
                                                     else []))
    if args.name not in names:
        print(f"deltastream bench: unknown benchmark {args.name!r}; expected one of "
              f"{', '.join(names + ['all', 'list'])}", file=sys.stderr)
        return EXIT_USAGE
    # argparse.REMAINDER swallows flags after the name; --json belongs to us, not the bench.
    bench_args = [a for a in args.bench_args if a != "--json"]
    as_json = args.json or len(bench_args) != len(args.bench_args)
    results = _import_bench(args.name).main(bench_args)
    common.emit(results, as_json)
    return EXIT_OK


def _unavailable(what: str, e: BaseException) -> int:
    """One line for a broker/topic problem (with kafka-python's last complaint), exit 3."""
    text = str(e) if isinstance(e, DeltastreamError) else error_text(e)
    print(f"{what}: {text}{kafka_hint(text)}", file=sys.stderr)
    return EXIT_UNAVAILABLE


def _cmd_topic(args: argparse.Namespace) -> int:
    from deltastream.publishing.topics import ensure_topic

    topic = args.topic or f"deltas.{args.model}"
    problem = refused_everywhere(args.bootstrap_servers) \
        or tls_probe(args.bootstrap_servers, args.kafka, min(args.timeout, 10.0))
    if problem:
        print(f"deltastream topic: error: {problem}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    try:
        partitions = ensure_topic(args.bootstrap_servers, topic, args.partitions,
                                  timeout=args.timeout, **args.kafka)
    except ValueError as e:
        print(f"deltastream topic: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except DeltastreamError as e:
        return _unavailable("deltastream topic: error", e)
    print(f"{topic}: {partitions} partitions on {args.bootstrap_servers}")
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace) -> int:
    from deltastream_demo.run import run_demo_cli  # the demo sits above the library: load it on use

    return run_demo_cli(args)


def _cmd_broker(args: argparse.Namespace) -> int:
    from deltastream.broker import serve_foreground

    return serve_foreground(args.port)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``deltastream``."""
    p = EnvArgumentParser(prog=PROG, description=__doc__.splitlines()[0], epilog=EXIT_CODES)
    add_logging_arguments(p, kind=None)  # each subcommand's kind
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    b = sub.add_parser("bench", env_prefix="DELTASTREAM_BENCH_", epilog=EXIT_CODES,
                       help="run a benchmark of a source checkout (figure vs a same-run "
                            "baseline)",
                       description="Run the benchmarks of a source checkout's bench/ "
                                   "directory (they are not installed with the package): "
                                   f"${BENCH_DIR_ENV}, else the checkout this package was "
                                   "installed from (pip install -e .), else the current "
                                   "directory.")
    add_logging_arguments(b, kind=ONE_SHOT, again=p)
    b.add_argument("name", help="benchmark name, 'list' or 'all'")
    b.add_argument("--json", action="store_true", help="print one JSON object per figure")
    b.add_argument("--write", default=None, metavar="FILE",
                   help="with 'all': regenerate this markdown file (e.g. BENCHMARKS.md)")
    b.add_argument("bench_args", nargs=argparse.REMAINDER,
                   help="options passed to the benchmark itself (see its --help)")
    b.set_defaults(func=_cmd_bench)

    t = sub.add_parser("topic", env_prefix="DELTASTREAM_TOPIC_", epilog=EXIT_CODES,
                       help="create the deltas topic if missing (idempotent)",
                       description="Create the deltas topic with --partitions partitions "
                                   "unless it exists; print its partition count.")
    add_logging_arguments(t, kind=ONE_SHOT, again=p)
    add_kafka_arguments(t)
    t.add_argument("--model", default=DEFAULT_MODEL,
                   help="model name; the topic defaults to deltas.<model> (the demo's "
                        "default, so the demo uses this topic)")
    t.add_argument("--topic", default=None, help="topic name (default deltas.<model>)")
    t.add_argument("--partitions", type=positive_int, default=1,
                   help="partitions to create; use at least the number of trainer shards")
    t.add_argument("--timeout", type=positive_float, default=BROKER_TIMEOUT_S, metavar="S",
                   help="seconds to reach the broker and see the topic (as deltastream-replay)")
    t.set_defaults(func=_cmd_topic, kafka_prefix="DELTASTREAM_TOPIC_", sub_parser=t)

    k = sub.add_parser("broker", env_prefix="DELTASTREAM_BROKER_", epilog=EXIT_CODES,
                       help="run the embedded broker (in memory) in the foreground",
                       description="Start the embedded Kafka-compatible broker (Tansu, in "
                                   "memory, 127.0.0.1 only) for trying the tools; print its "
                                   "bootstrap address on stdout once it answers; SIGTERM or "
                                   "Ctrl-C stops it (exit 0). Its data is gone when it stops.")
    add_logging_arguments(k, kind=SERVICE, again=p)
    from deltastream.broker import add_broker_arguments

    add_broker_arguments(k)
    k.set_defaults(func=_cmd_broker)

    d = sub.add_parser("demo", env_prefix="DELTASTREAM_DEMO_", epilog=EXIT_CODES,
                       help="train a small CTR model and stream its deltas to a "
                            "predictor end to end; writes a report",
                       description="Train a small CTR model online on a synthetic click "
                                   "stream (trainer processes) and stream its deltas through "
                                   "Kafka to a predictor (a sync daemon); print and write a "
                                   "report (report.json) and pictures (learning.png: loss "
                                   "and serving vs trainer AUC over the run; published.png: "
                                   "bytes/s and rows/s against the budget; freshness.png; "
                                   "bound.png: the serving-error bound) to --out. About 2 "
                                   "minutes on 2 cores.")
    add_logging_arguments(d, kind=SERVICE, again=p)
    from deltastream_demo.run import add_demo_arguments

    add_demo_arguments(d)
    d.set_defaults(func=_cmd_demo)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``deltastream``; returns the process exit code."""
    args = build_parser().parse_args(argv)
    # the demo reads its Kafka settings itself (deltastream_demo.run); topic here, before any logging
    args.kafka = (kafka_settings(args, args.sub_parser, args.kafka_prefix)
                  if args.command == "topic" else {})
    setup_cli_logging(args, secrets=secret_values(args.kafka))
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
