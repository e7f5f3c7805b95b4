"""bench/device_checks.sh and bench/_device_summary.py: the GPU checks a lent machine runs.

Such a machine is lent for minutes, so the script must not fail there on a flag or a
summary: its commands are parsed here by the parsers that will read them, and its summary
is made from records shaped as the bench and the demo write them.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from bench import _device_summary, trainer_cost
from deltastream.cli import build_parser
from deltastream_demo.options import options_from_args

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "device_checks.sh"


def _dry_run() -> dict[str, tuple[int, list[str]]]:
    """``{stage: (its time limit in s, argv)}`` of the script's dry run, in order."""
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    stages = {}
    for line in out.splitlines():
        head, _, cmd = line.partition("] ")
        name, limit = head.lstrip("[").split(", ")
        stages[name] = (int(limit.removesuffix(" s")), shlex.split(cmd))
    return stages


def test_the_dry_run_lists_every_stage_in_order_within_one_device_call():
    stages = _dry_run()
    assert list(stages) == ["build", "gpu-tests", "trainer-cost", "demo-cuda-w1-b8192",
                            "demo-cuda-w1-b512", "demo-cpu-w2-b512", "demo-cpu-w2-b8192",
                            "trainer-cost-cpu"]
    # the whole run's own limit (540 s) caps the stages; their typical times are far less
    assert all(0 < limit <= 180 for limit, _ in stages.values())


def test_the_scripts_commands_parse_with_the_parsers_that_will_read_them():
    stages = {name: argv for name, (_, argv) in _dry_run().items()}
    for stage, device, configs in (
            ("trainer-cost", "cuda", ["tracker", "tracker-idle", "budget-50000", "rounds-10"]),
            ("trainer-cost-cpu", "cpu", ["tracker-idle", "budget-50000", "rounds-10"])):
        tc = stages[stage]
        i = tc.index("trainer-cost")
        args = trainer_cost.parser().parse_args([a for a in tc[i + 1:] if a != "--json"])
        assert args.device == device and args.batches == [4096]
        assert [name for name, _ in trainer_cost._configurations(args)] == configs
    for name in ("demo-cuda-w1-b8192", "demo-cpu-w2-b512"):
        argv = stages[name]
        opts = options_from_args(build_parser().parse_args(argv[argv.index("demo"):]))
        if opts.device == "cpu":  # validate() asks torch for the GPU the cuda run needs
            opts.validate()
        assert (opts.device, opts.workers) == (("cuda", 1) if "cuda" in name else ("cpu", 2))
        assert opts.resolved_batch_size == int(name.rsplit("-b", 1)[1])
    paths = [a for a in stages["gpu-tests"] if a.startswith("tests/")]
    assert paths and all((ROOT / p).exists() for p in paths), paths


def test_the_summary_reads_the_bench_and_demo_records(tmp_path):
    record = {"config": "budget-50000", "batch": 4096, "ratio": 1.0321,
              "ratio_ci95": [1.01, 1.05], "tick_p99_ms": 0.4123, "bytes_per_s": 50123.4}
    idle = dict(record, config="tracker", tick_p99_ms=None, bytes_per_s=0.0)
    (tmp_path / "tc.json").write_text(json.dumps(record) + "\n" + json.dumps(idle) + "\n")
    lines = _device_summary.trainer_cost_lines(tmp_path / "tc.json")
    assert lines == [
        "  budget-50000  b4096 ratio 1.032 (1.010-1.050), tick p99 0.41 ms, 50,123 B/s",
        "  tracker       b4096 ratio 1.032 (1.010-1.050), tick p99 -, 0 B/s"]

    demos = tmp_path / "demos"
    for name, rate in (("cuda-w1-b8192", 600_000), ("cuda-w1-b512", 90_000),
                       ("cpu-w2-b512", 60_000), ("cpu-w2-b8192", 300_000)):
        (demos / name).mkdir(parents=True)
        (demos / name / "report.json").write_text(
            json.dumps({"train": {"examples_per_s": rate}}))
    (demos / "cpu-w1-b512").mkdir()  # a run that wrote no report: named, not fatal
    lines = _device_summary.demo_lines(demos, "cuda")
    assert lines[0].startswith("  cpu-w1-b512: no report (FileNotFoundError")
    assert "  cuda-w1-b8192         600,000 examples/s" in lines
    assert lines[-3:] == ["  cuda-w1-b8192 / cpu-w2-b512: 10.00",
                          "  cuda-w1-b512 / cpu-w2-b512: 1.50",
                          "  cuda-w1-b8192 / cpu-w2-b8192: 2.00"]


@pytest.mark.parametrize("argv", [[], ["trainer-cost"], ["demo", "x"], ["nope"]])
def test_the_summary_command_refuses_a_bad_call(argv, capsys):
    assert _device_summary.main(argv) == 2
    assert "usage:" in capsys.readouterr().err


def test_a_run_out_of_time_skips_every_stage_says_so_and_fails(tmp_path):
    """The run's own limit at 0: nothing heavy runs, every stage is named as skipped in the
    summary, the summary still closes with each stage's records (none), and the exit status
    says the checks are incomplete."""
    env = {**os.environ, "PYTHON": sys.executable, "DEVICE_CHECKS_TOTAL_S": "0",
           "DEVICE_CHECKS_WHEELS": str(tmp_path / "no-wheels")}
    run = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    assert run.stderr == ""
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert summary[0].startswith(f"python {platform.python_version()}, torch ")
    assert summary[1].startswith("missing: ")
    skipped = [line.split(":")[0] for line in summary if ": skipped, " in line]
    assert skipped == list(_dry_run())
    assert summary[-2] == "  no demo ran" and "  no records" not in summary
    assert summary[-1].startswith("trainer-cost-cpu: skipped, ")
    assert run.stdout.splitlines() == summary  # the same lines, live on stdout
