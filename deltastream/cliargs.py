"""argparse helpers: every flag also reads a ``DELTASTREAM_*`` environment variable.

Torch-free, shared by the trainer-side ``deltastream`` CLI and the predictor CLIs.
A flag ``--state-dir`` defaults from ``DELTASTREAM_STATE_DIR``; the command line wins.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["EnvArgumentParser", "env_name"]

ENV_PREFIX = "DELTASTREAM_"


def env_name(dest: str) -> str:
    """Environment variable for a flag name or dest: ``state-dir`` -> ``DELTASTREAM_STATE_DIR``."""
    return ENV_PREFIX + dest.upper().replace("-", "_")


class EnvArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose optional flags default from ``DELTASTREAM_<FLAG>``.

    The variable is named in each flag's help. Values from the environment go through
    the flag's ``type`` and ``choices`` like command-line values; ``store_true`` flags
    accept 1/true/yes/on and 0/false/no/off.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        if not action.option_strings or action.dest in ("help", "version"):
            return action
        # Named after the long flag, not the dest: `--model` (dest model_name) reads
        # DELTASTREAM_MODEL, which is what a user reading --help expects.
        longs = [o for o in action.option_strings if o.startswith("--")]
        var = env_name(longs[0][2:] if longs else action.dest)
        action.help = (action.help or "") + f" [env {var}]"
        raw = os.environ.get(var)
        if raw is None:
            return action
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            truth = raw.strip().lower()
            if truth not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                self.error(f"{var}={raw!r}: expected 1/true/yes/on or 0/false/no/off")
            on = truth in ("1", "true", "yes", "on")
            action.default = on if isinstance(action, argparse._StoreTrueAction) else not on
            return action
        action.default = self._convert(action, raw, var)
        action.required = False
        return action

    def _convert(self, action: argparse.Action, raw: str, var: str) -> Any:
        values: Sequence[str] = raw.split() if action.nargs in ("+", "*") else [raw]
        out = []
        for v in values:
            try:
                value = action.type(v) if action.type else v
            except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
                self.error(f"{var}={raw!r}: {e}")
            if action.choices is not None and value not in action.choices:
                self.error(f"{var}={raw!r}: expected one of {list(action.choices)}")
            out.append(value)
        return out if action.nargs in ("+", "*") else out[0]
