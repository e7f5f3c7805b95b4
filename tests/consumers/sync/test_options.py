"""SyncOptions: each daemon setting spelled once (default, help, flag); the daemon and the
``deltastream-sync`` command line are both built from it."""

from __future__ import annotations

import dataclasses

import pytest

from consumers.sync import SyncDaemon, SyncOptions
from consumers.sync.cli import build_parser


def _flag_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(SyncOptions) if f.metadata.get("flag") is not None]


def test_every_field_has_help_and_the_docstring_lists_it():
    for f in dataclasses.fields(SyncOptions):
        assert f.metadata.get("help"), f.name
        assert f"{f.name}: {f.metadata['help']}" in SyncOptions.__doc__


def test_the_command_line_is_generated_from_the_fields():
    from deltastream.cliargs import first_sentence

    actions = {a.dest: a for a in build_parser()._actions}
    for f in _flag_fields():
        action = actions[f.name]
        assert action.option_strings == ["--" + f.name.replace("_", "-")]
        # the first sentence (brief --help; the variables are behind --help-env)
        assert action.help == first_sentence(f.metadata["help"])
        if "default" not in f.metadata["flag"] and not action.required \
                and f.default is not dataclasses.MISSING:
            assert action.default == f.default, f.name
    # options that are not flags: programmatic only (a callable, consumer tuning)
    assert {"on_apply", "consumer_config", "poll_timeout_ms"} <= \
        {f.name for f in dataclasses.fields(SyncOptions)} - set(actions)


def test_flags_parse_into_options(tmp_path):
    args = build_parser().parse_args(
        ["--bootstrap-servers", "127.0.0.1:9", "--model", "m", "--state-dir", str(tmp_path),
         "--shards", "0,2", "--tables", "u:4", "--checkpoint-interval", "0.5",
         "--share-tables", "--quarantine-max-bytes", "10"])
    from deltastream.cliargs import field_values

    o = SyncOptions(args.bootstrap_servers, **{**field_values(args, SyncOptions),
                                               "topic": "deltas.m"})
    assert (o.shards, o.tables, o.checkpoint_interval, o.share_tables) == \
        ({0, 2}, {"u": 4}, 0.5, True)
    assert o.quarantine_max_bytes == 1024  # raised to the floor, as before


def test_daemon_takes_options_or_keywords(tmp_path):
    o = SyncOptions("127.0.0.1:9", "deltas.m", "m", tmp_path / "a", shards=[1],
                    request_timeout=0.5)
    d = SyncDaemon(o)
    try:
        assert d.options is o and d.shards == {1} and d.topic == "deltas.m"
    finally:
        d.close()
    d = SyncDaemon("127.0.0.1:9", "deltas.m", model="m", state_dir=tmp_path / "b",
                   request_timeout=0.5, client_id="x")
    try:
        assert d.options.consumer_config == {"client_id": "x"}
        assert d.request_timeout == 0.5 and d.model == "m"
    finally:
        d.close()
    with pytest.raises(TypeError, match="not both"):
        SyncDaemon(o, "deltas.m")
    with pytest.raises(TypeError, match="unknown SyncDaemon"):
        SyncDaemon("127.0.0.1:9", "t", model="m", state_dir=tmp_path / "c", no_such=1)
