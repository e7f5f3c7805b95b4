"""The ``deltastream`` command: ``demo``, ``bench`` and ``topic`` subcommands.

Every flag also reads a ``DELTASTREAM_*`` environment variable (see :mod:`deltastream.cliargs`).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from deltastream.cliargs import EnvArgumentParser

__all__ = ["main", "bench_names"]

log = logging.getLogger(__name__)

_REPO = Path(__file__).resolve().parent.parent


def bench_names() -> list[str]:
    """Benchmarks found in the source tree's ``bench/`` directory, in CLI spelling."""
    d = _REPO / "bench"
    return sorted(p.stem.replace("_", "-") for p in d.glob("*.py")
                  if not p.stem.startswith("_") and p.stem != "run_all")


def _import_bench(name: str):
    if not (_REPO / "bench" / "_common.py").is_file():
        raise SystemExit("deltastream bench: the bench/ directory is not next to the package; "
                         "run from a source checkout (pip install -e .)")
    if str(_REPO) not in sys.path:
        sys.path.insert(0, str(_REPO))
    return importlib.import_module(f"bench.{name.replace('-', '_')}")


def _cmd_bench(args: argparse.Namespace) -> int:
    names = bench_names()
    if args.name == "list":
        print("\n".join(names))
        return 0
    common = _import_bench("_common")
    if args.name == "all":
        runner = _import_bench("run_all")
        # flags after "all" land in bench_args (REMAINDER); run_all parses them itself
        return runner.main(list(args.bench_args) + (["--write", args.write] if args.write
                                                     else []))
    if args.name not in names:
        print(f"deltastream bench: unknown benchmark {args.name!r}; expected one of "
              f"{', '.join(names + ['all', 'list'])}", file=sys.stderr)
        return 2
    # argparse.REMAINDER swallows flags after the name; --json belongs to us, not the bench.
    bench_args = [a for a in args.bench_args if a != "--json"]
    as_json = args.json or len(bench_args) != len(args.bench_args)
    results = _import_bench(args.name).main(bench_args)
    common.emit(results, as_json)
    return 0


def _cmd_topic(args: argparse.Namespace) -> int:
    from deltastream.publishing.topics import ensure_topic

    topic = args.topic or f"deltas.{args.model}"
    partitions = ensure_topic(args.bootstrap_servers, topic, args.partitions)
    print(f"{topic}: {partitions} partitions on {args.bootstrap_servers}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from demo.run import run_demo_cli  # the demo sits above the library: load it on use

    return run_demo_cli(args)


def build_parser() -> argparse.ArgumentParser:
    p = EnvArgumentParser(prog="deltastream", description=__doc__.splitlines()[0])
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging level")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("bench", help="run a benchmark (figure vs a same-run baseline)")
    b.add_argument("name", help="benchmark name, 'list' or 'all'")
    b.add_argument("--json", action="store_true", help="print one JSON object per figure")
    b.add_argument("--write", default=None,
                   help="with 'all': regenerate this markdown file (e.g. BENCHMARKS.md)")
    b.add_argument("bench_args", nargs=argparse.REMAINDER,
                   help="options passed to the benchmark itself (see its --help)")
    b.set_defaults(func=_cmd_bench)

    t = sub.add_parser("topic", help="create the deltas topic if missing (idempotent)")
    t.add_argument("--bootstrap-servers", required=True, help="Kafka bootstrap servers host:port")
    t.add_argument("--model", default="model", help="model name; the topic defaults to deltas.<model>")
    t.add_argument("--topic", default=None, help="topic name (default deltas.<model>)")
    t.add_argument("--partitions", type=int, default=1,
                   help="partitions to create; use at least the number of trainer shards")
    t.set_defaults(func=_cmd_topic)

    d = sub.add_parser("demo", help="train a small CTR model and stream its deltas to a "
                                    "predictor end to end; writes a report")
    from demo.run import add_demo_arguments

    add_demo_arguments(d)
    d.set_defaults(func=_cmd_demo)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
