"""deltastream-replay's flags are generated from its option dataclasses: each flag is spelled
once, and the read range's fields are the keywords of the public replay functions."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from consumers.replay import options
from consumers.replay.cli import build_parser
from consumers.replay.inspect import dump, stats
from consumers.replay.rebuild import rebuild

USES = {"rebuild": (options.Source, options.ReadRange, options.RebuildFlags),
        "dump": (options.Source, options.ReadRange, options.StreamFilter, options.DumpFlags),
        "stats": (options.Source, options.ReadRange, options.StreamFilter, options.StatsFlags),
        "diff": (options.Source, options.DiffFlags)}


def _subparsers() -> dict:
    p = build_parser()
    action = next(a for a in p._actions if a.dest == "command")
    return action.choices


@pytest.mark.parametrize("command", sorted(USES))
def test_every_field_is_one_flag_of_its_subcommands(command):
    sp = _subparsers()[command]
    for settings in USES[command]:
        for f in dataclasses.fields(settings):
            flags = [a for a in sp._actions if a.dest == f.name]
            assert len(flags) == 1, (command, f.name)
            want = options.DIFF_SOURCE_HELP.get(f.name) if command == "diff" else None
            assert flags[0].help.startswith(want or f.metadata["help"])  # + its env names
            if flags[0].option_strings and f.metadata["flag"].get("action") != "store_true" \
                    and not flags[0].required:
                assert flags[0].default == f.default


@pytest.mark.parametrize("fn", [rebuild, dump, stats])
def test_the_read_range_fields_are_keywords_of_the_replay_functions(fn):
    params = inspect.signature(fn).parameters
    for f in dataclasses.fields(options.ReadRange):
        assert f.name in params, (fn.__name__, f.name)
        assert params[f.name].kind in (inspect.Parameter.KEYWORD_ONLY,
                                       inspect.Parameter.POSITIONAL_OR_KEYWORD)
