"""Flags default from DELTASTREAM_* environment variables; the command line wins."""

from __future__ import annotations

import pytest

from deltastream.cliargs import EnvArgumentParser, env_name


def make_parser() -> EnvArgumentParser:
    p = EnvArgumentParser(prog="t")
    p.add_argument("--state-dir", required=True, help="where state lives")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mode", choices=["a", "b"], default="a")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--shards", type=int, nargs="+", default=[0])
    return p


def test_env_name():
    assert env_name("state_dir") == "DELTASTREAM_STATE_DIR"


def test_environment_defaults_and_command_line_wins(monkeypatch):
    monkeypatch.setenv("DELTASTREAM_STATE_DIR", "/s")
    monkeypatch.setenv("DELTASTREAM_WORKERS", "4")
    monkeypatch.setenv("DELTASTREAM_VERBOSE", "yes")
    monkeypatch.setenv("DELTASTREAM_SHARDS", "1 2")
    a = make_parser().parse_args([])
    assert (a.state_dir, a.workers, a.verbose, a.shards) == ("/s", 4, True, [1, 2])
    b = make_parser().parse_args(["--workers", "8", "--state-dir", "/x"])
    assert (b.workers, b.state_dir) == (8, "/x")


def test_required_flag_still_required_without_env(monkeypatch):
    monkeypatch.delenv("DELTASTREAM_STATE_DIR", raising=False)
    with pytest.raises(SystemExit):
        make_parser().parse_args([])


@pytest.mark.parametrize("var, value", [("DELTASTREAM_WORKERS", "many"),
                                        ("DELTASTREAM_MODE", "c"),
                                        ("DELTASTREAM_VERBOSE", "perhaps")])
def test_bad_environment_values_are_usage_errors(monkeypatch, capsys, var, value):
    monkeypatch.setenv("DELTASTREAM_STATE_DIR", "/s")
    monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as e:
        make_parser()
    assert e.value.code == 2
    assert var in capsys.readouterr().err


def test_help_names_the_variables(capsys):
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for var in ("DELTASTREAM_STATE_DIR", "DELTASTREAM_WORKERS", "DELTASTREAM_VERBOSE"):
        assert var in out
