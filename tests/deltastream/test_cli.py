"""The `deltastream` CLI dispatches benchmarks and renders BENCHMARKS.md."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from deltastream.cli import bench_names, main
from deltastream.cliargs import (
    DEFAULT_LOG_LEVELS,
    ONE_SHOT,
    SERVICE,
    VERBOSE_LOG_LEVEL,
    chosen_log_level,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench._common import result  # noqa: E402
from bench.run_all import render  # noqa: E402


def test_bench_list_names_every_benchmark(capsys):
    assert main(["bench", "list"]) == 0
    listed = capsys.readouterr().out.split()
    assert listed == bench_names()
    assert {"codec", "publish", "hashtable", "compaction", "tracker-overhead", "selection",
            "apply", "e2e", "topk-tradeoff", "train-step"} <= set(listed)


def test_unknown_benchmark_is_a_usage_error(capsys):
    assert main(["bench", "no-such-bench"]) == 2
    assert "unknown benchmark" in capsys.readouterr().err


def test_json_flag_after_the_name_and_bench_options(capsys):
    args = ["bench", "codec", "--json", "--rows", "2000", "--repeat", "1", "--rounds", "1"]
    assert main(args) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()
               if line.startswith("{")]
    assert records, "no JSON records printed"
    for r in records:
        assert {"name", "value", "baseline", "ratio", "goal", "unit"} <= set(r)
        assert r["value"] > 0 and r["baseline"] > 0


def test_train_step_bench_runs_small_on_cpu_and_refuses_cuda_without_it(capsys):
    import pytest
    import torch

    args = ["bench", "train-step", "--json", "--batch", "64", "--users", "300", "--items",
            "60", "--rounds", "2", "--read-every", "2", "--dim", "8"]
    assert main(args) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()
               if line.startswith("{")]
    assert [r["name"] for r in records] == ["train_step.hashtable", "train_step.id_only",
                                            "train_step.embedding"]
    assert all(r["value"] > 0 and r["baseline"] > 0 for r in records)
    assert records[0]["examples_per_s"] > 0 and "overhead_pct" in records[1]
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            main(["bench", "train-step", "--device", "cuda"])
        assert "torch.cuda.is_available() is False" in capsys.readouterr().err


def test_stalls_bench_runs_small_and_leaves_the_affinity_as_it_was(capsys):
    import os

    import pytest

    cpus = os.sched_getaffinity(0)
    args = ["bench", "stalls", "--json", "--mib", "4", "--rounds", "1", "--rest", "0"]
    assert main(args) == 0
    assert os.sched_getaffinity(0) == cpus
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()
               if line.startswith("{")]
    assert [r["name"] for r in records] == ["stalls.write", "stalls.collapse"]
    assert all(r["value"] >= 0 and r["baseline"] >= 0 and r["mib"] == 4 for r in records)
    for bad in (["--mib", "0"], ["--rest", "-1"], ["--shm-dir", "/no/such/dir"]):
        with pytest.raises(SystemExit):
            main(["bench", "stalls", *bad])
    assert "--shm-dir: /no/such/dir is not a directory" in capsys.readouterr().err


def test_growth_bench_runs_small_both_ways_and_leaves_nothing(capsys, request):
    import os
    import tempfile
    from pathlib import Path

    import pytest

    # on a tmpfs: elsewhere the kernel refuses to collapse, and hugemap stops asking
    shm = Path(tempfile.mkdtemp(prefix="ds-test-growth-", dir="/dev/shm"))
    request.addfinalizer(lambda: shm.rmdir())
    assert "DELTASTREAM_SHM_BACKER" not in os.environ
    args = ["bench", "growth", "--json", "--rows", "200000", "--rounds", "1", "--rest", "0",
            "--shm-dir", str(shm)]
    assert main(args) == 0
    assert "DELTASTREAM_SHM_BACKER" not in os.environ  # put back as it was
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()
               if line.startswith("{")]
    assert [r["name"] for r in records] == ["growth.rows_per_s", "growth.apply_max_ms",
                                            "growth.min_window"]
    assert all(r["value"] > 0 and r["baseline"] > 0 for r in records[:2])
    assert list(shm.iterdir()) == []  # both tables removed their files
    for bad in (["--rows", "0"], ["--rest", "-1"], ["--shm-dir", "/no/such/dir"]):
        with pytest.raises(SystemExit):
            main(["bench", "growth", *bad])
    assert "--shm-dir: expected an existing directory" in capsys.readouterr().err


def test_checkpoint_io_bench_runs_small(capsys, tmp_path):
    import pytest

    args = ["bench", "checkpoint-io", "--json", "--rows", "5000", "--dim", "8", "--repeat", "1",
            "--dir", str(tmp_path)]
    assert main(args) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()
               if line.startswith("{")]
    assert [r["name"] for r in records] == ["checkpoint_io.write", "checkpoint_io.verify"]
    assert all(r["value"] > 0 and r["baseline"] > 0 for r in records)
    assert list(tmp_path.iterdir()) == []  # its temp dir is gone
    with pytest.raises(SystemExit):
        main(["bench", "checkpoint-io", "--rows", "0"])


def test_render_marks_pass_short_info_and_failures():
    runs = {
        "a": ([result("fast", 2.0, 1.0, 1.5, "x/s"), result("slow", 1.0, 1.0, 1.5, "x/s"),
               result("info", 3.0, 1.0, None, "x/s")], "", 1.0),
        "b": ([], "exit 1: boom", 2.0),
    }
    md = render(runs)
    assert "| a | fast | 2 | x/s | 1 | 2 | ≥ 1.5 | pass |" in md
    assert "| a | slow | 1 | x/s | 1 | 1 | ≥ 1.5 | **short** |" in md
    assert "| a | info |" in md and "| info |" in md
    assert "FAILED: exit 1: boom" in md


def test_bench_all_runs_freshness_on_both_logs_and_passes_each_runs_arguments():
    from bench import run_all

    assert run_all.RUNS["freshness-per-byte"] == [[], ["--dataset", "ml-latest-small"]]
    # the arguments reach the benchmark's own parser: a bad one fails that run, by name
    results, err, _ = run_all.run_one("codec", args=["--rows", "many"])
    assert results == [] and "exit 2" in err
    results, err, _ = run_all.run_one("codec", args=["--rows", "2000", "--repeat", "1",
                                                     "--rounds", "1"])
    assert err == "" and results


def test_demo_help_says_what_the_demo_does_and_draws(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    head = out[out.index("\n\n") + 2:].split("\n\n", 1)[0]  # the paragraph after usage
    assert head.startswith("Train a small CTR model online")
    for png in ("learning.png", "published.png", "freshness.png", "bound.png"):
        assert png in out


def test_topic_and_demo_default_to_the_same_model():
    from deltastream.cli import build_parser
    from deltastream_demo.options import DemoOptions

    topic = build_parser().parse_args(["topic", "--bootstrap-servers", "h:1"])
    assert topic.model == DemoOptions().model_name  # deltastream topic makes deltas.demo


def test_the_one_shot_tools_wait_as_long_for_the_broker():
    from consumers.replay.cli import build_parser as replay_parser
    from deltastream.cli import build_parser

    topic = build_parser().parse_args(["topic", "--bootstrap-servers", "h:1"])
    for sub in ("stats", "dump", "rebuild"):
        replay = replay_parser().parse_args([sub, "--bootstrap-servers", "h:1",
                                             *(["--out", "o"] if sub == "rebuild" else [])])
        assert replay.timeout == topic.timeout, sub


_LOG_CASES = [  # (tool, argv, kind): services log at INFO, one-shot tools at WARNING
    ("deltastream", ["topic", "--bootstrap-servers", "h:1"], ONE_SHOT),
    ("deltastream", ["bench", "list"], ONE_SHOT),
    ("deltastream", ["broker"], SERVICE),
    ("deltastream", ["demo"], SERVICE),
    ("replay", ["stats", "--bootstrap-servers", "h:1"], ONE_SHOT),
    ("sync", ["--bootstrap-servers", "h:1", "--model", "m", "--state-dir", "s"], SERVICE),
]


def _parse(tool: str, argv: list[str]):
    from consumers.replay.cli import build_parser as replay_parser
    from consumers.sync.cli import build_parser as sync_parser
    from deltastream.cli import build_parser

    parser = {"deltastream": build_parser, "replay": replay_parser, "sync": sync_parser}[tool]
    return parser().parse_args(argv)


@pytest.mark.parametrize("tool, argv, kind", _LOG_CASES,
                         ids=[f"{t} {a[0]}" for t, a, _ in _LOG_CASES])
def test_each_command_logs_at_its_kinds_level_unless_told(tool, argv, kind, monkeypatch):
    for var in [v for v in os.environ if v.endswith("LOG_LEVEL")]:
        monkeypatch.delenv(var)

    def level(flag: list[str], before: bool = False) -> str:
        """The level of ``argv`` with ``flag`` before or after its subcommand (sync: last)."""
        at = len(argv) if tool == "sync" else 0 if before else 1
        return chosen_log_level(_parse(tool, [*argv[:at], *flag, *argv[at:]]))

    assert level([]) == DEFAULT_LOG_LEVELS[kind]
    assert level(["--log-level", "ERROR"]) == "ERROR"
    assert level(["--log-level", "DEBUG"], before=True) == "DEBUG"
    assert level(["-v"]) == VERBOSE_LOG_LEVEL  # kafka-python's lines are INFO lines
    assert level(["-v", "--log-level", "ERROR"]) == "ERROR"
    monkeypatch.setenv("DELTASTREAM_LOG_LEVEL", "ERROR")
    assert level([]) == "ERROR"
    assert level(["--log-level", "INFO"]) == "INFO"


@pytest.mark.parametrize("cmd, kind", [("topic", ONE_SHOT), ("broker", SERVICE)])
def test_a_subcommands_help_gives_its_default_log_level(cmd, kind, capsys):
    with pytest.raises(SystemExit):
        main([cmd, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"default for this command: {DEFAULT_LOG_LEVELS[kind]}" in out
