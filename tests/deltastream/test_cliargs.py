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


@pytest.mark.parametrize("var, value, flag", [("DELTASTREAM_WORKERS", "many", "--workers"),
                                              ("DELTASTREAM_MODE", "c", "--mode"),
                                              ("DELTASTREAM_VERBOSE", "perhaps", None)])
def test_bad_environment_values_are_usage_errors_unless_the_command_line_wins(
        monkeypatch, capsys, var, value, flag):
    monkeypatch.setenv("DELTASTREAM_STATE_DIR", "/s")
    monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as e:
        make_parser().parse_args([])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert var in err and err.startswith("t: error:")
    if flag is not None:  # given on the command line, the variable is not read
        good = {"--workers": "3", "--mode": "b"}[flag]
        assert getattr(make_parser().parse_args([flag, good]), flag[2:]) == \
            (int(good) if flag == "--workers" else good)


def test_a_bad_variable_of_another_subcommand_is_not_this_ones_error(monkeypatch):
    monkeypatch.setenv("DELTASTREAM_T_B_WORKERS", "many")
    p = EnvArgumentParser(prog="t")
    sub = p.add_subparsers(dest="cmd")
    for name in ("a", "b"):
        sub.add_parser(name, env_prefix=f"DELTASTREAM_T_{name.upper()}_").add_argument(
            "--workers", type=int, default=1)
    assert p.parse_args(["a"]).workers == 1  # b's variable: not read
    with pytest.raises(SystemExit):
        p.parse_args(["b"])


def test_help_names_the_variables(capsys):
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for var in ("DELTASTREAM_STATE_DIR", "DELTASTREAM_WORKERS", "DELTASTREAM_VERBOSE"):
        assert var in out


# ----------------------------------------------------------------------------- tool prefixes


def tool_parser() -> EnvArgumentParser:
    from deltastream.cliargs import ListAction, add_kafka_arguments, comma_list

    p = EnvArgumentParser(prog="tool", env_prefix="DELTASTREAM_TOOL_")
    add_kafka_arguments(p)
    p.add_argument("--model", required=True)
    p.add_argument("--base", action=ListAction, type=comma_list, default=None)
    sub = p.add_subparsers(dest="cmd")
    s = sub.add_parser("dump", env_prefix="DELTASTREAM_TOOL_DUMP_", env_parent="DELTASTREAM_TOOL_")
    s.add_argument("--limit", type=int, default=None)
    s.add_argument("--out", default="-", env_local=True)
    return p


def test_tool_variable_wins_over_the_shared_one(monkeypatch):
    monkeypatch.setenv("DELTASTREAM_BOOTSTRAP_SERVERS", "shared:1")
    monkeypatch.setenv("DELTASTREAM_MODEL", "flat")  # not a shared setting: never read
    monkeypatch.setenv("DELTASTREAM_TOOL_MODEL", "mine")
    a = tool_parser().parse_args([])
    assert (a.bootstrap_servers, a.model) == ("shared:1", "mine")
    monkeypatch.setenv("DELTASTREAM_TOOL_BOOTSTRAP_SERVERS", "tool:2")
    assert tool_parser().parse_args([]).bootstrap_servers == "tool:2"
    assert tool_parser().parse_args(["--bootstrap-servers", "cli:3"]).bootstrap_servers \
        == "cli:3"


def test_subcommand_variables_then_tool_wide_and_local_flags(monkeypatch):
    monkeypatch.setenv("DELTASTREAM_TOOL_MODEL", "m")
    monkeypatch.setenv("DELTASTREAM_TOOL_BOOTSTRAP_SERVERS", "h:1")
    monkeypatch.setenv("DELTASTREAM_TOOL_LIMIT", "5")
    monkeypatch.setenv("DELTASTREAM_TOOL_OUT", "x.txt")  # --out reads only its own name
    a = tool_parser().parse_args(["dump"])
    assert (a.limit, a.out) == (5, "-")
    monkeypatch.setenv("DELTASTREAM_TOOL_DUMP_LIMIT", "7")
    monkeypatch.setenv("DELTASTREAM_TOOL_DUMP_OUT", "y.txt")
    a = tool_parser().parse_args(["dump"])
    assert (a.limit, a.out) == (7, "y.txt")


def test_list_flag_repeats_and_replaces_the_environment(monkeypatch):
    monkeypatch.setenv("DELTASTREAM_TOOL_MODEL", "m")
    monkeypatch.setenv("DELTASTREAM_BOOTSTRAP_SERVERS", "h:1")
    monkeypatch.setenv("DELTASTREAM_TOOL_BASE", "e1,e2")
    assert tool_parser().parse_args([]).base == ["e1", "e2"]
    a = tool_parser().parse_args(["--base", "a,b", "--base", "c"])
    assert a.base == ["a", "b", "c"]


def test_missing_required_flag_names_its_variable(monkeypatch, capsys):
    monkeypatch.delenv("DELTASTREAM_BOOTSTRAP_SERVERS", raising=False)
    with pytest.raises(SystemExit) as e:
        tool_parser().parse_args([])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "--bootstrap-servers, --model" in err
    assert "(or set DELTASTREAM_BOOTSTRAP_SERVERS, DELTASTREAM_TOOL_MODEL)" in err


def test_help_shows_defaults_only_where_they_say_something(capsys):
    from deltastream.cliargs import HelpFormatter

    p = EnvArgumentParser(prog="t", description="The ``deltastream`` tool, see :mod:`x.y`.",
                          formatter_class=HelpFormatter)
    p.add_argument("--need", required=True, help="needed")
    p.add_argument("--maybe", default=None, help="optional")
    p.add_argument("--flag", action="store_true", help="a switch")
    p.add_argument("--n", type=int, default=3, help="a number")
    text = p.format_help()
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "(default: 3)" in text
    assert "``" not in text and ":mod:" not in text and "The deltastream tool, see x.y." in text


def test_error_text_does_not_double_the_type():
    import kafka.errors

    from deltastream.errors import error_text

    assert error_text(kafka.errors.KafkaTimeoutError("Unable to bootstrap")) == \
        "KafkaTimeoutError: Unable to bootstrap"
    assert error_text(OSError("disk full")) == "OSError: disk full"
    assert error_text(ValueError()) == "ValueError"


def test_a_misspelt_flag_of_the_subcommand_gets_a_suggestion(capsys):
    p = EnvArgumentParser(prog="tool", env_prefix="T_")
    sub = p.add_subparsers(dest="cmd")
    stats = sub.add_parser("stats", env_prefix="T_STATS_")
    stats.add_argument("--shard")
    stats.add_argument("--table")
    sub.add_parser("other").add_argument("--sharding")
    with pytest.raises(SystemExit) as e:
        p.parse_args(["stats", "--shards", "0"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --shards 0 (did you mean --shard?)" in err
    assert err.startswith("tool stats: error:") and "(see tool stats --help)" in err
    with pytest.raises(SystemExit):
        p.parse_args(["stats", "--tables", "a", "--shards=1"])
    assert "(did you mean --table for --tables, --shard for --shards?)" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        p.parse_args(["stats", "--bogus", "1"])
    assert "did you mean" not in capsys.readouterr().err  # nothing close: no guess


def test_a_brief_parser_gives_one_sentence_per_flag_and_variables_behind_help_env(capsys):
    from deltastream.cliargs import first_sentence

    assert first_sentence("Kafka settings, e.g. a=b. More here.") == "Kafka settings, e.g. a=b."
    assert first_sentence("Port (e.g. DELTASTREAM_X). Then (more).") == \
        "Port (e.g. DELTASTREAM_X)."
    p = EnvArgumentParser(prog="t", env_prefix="T_", brief=True)
    p.add_argument("--state-dir", help="Where the state lives. Created if missing.")
    p.print_help()
    out = capsys.readouterr().out
    assert "Where the state lives." in out and "Created" not in out and "T_STATE" not in out
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--help-env"])
    assert e.value.code == 0
    assert "--state-dir  T_STATE_DIR" in capsys.readouterr().out
