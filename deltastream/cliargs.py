"""argparse helpers: every flag also reads a ``DELTASTREAM_*`` environment variable.

Torch-free, shared by the trainer-side ``deltastream`` CLI and the predictor CLIs.
A flag ``--state-dir`` defaults from ``DELTASTREAM_STATE_DIR``; the command line wins.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["EnvArgumentParser", "env_name", "positive_float", "non_negative_float",
           "positive_int", "port"]

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


# Value types for flags. They raise ArgumentTypeError, so a bad value on the command line or
# in a DELTASTREAM_* variable is a usage error (exit 2) naming the flag or the variable.


def positive_float(text: str) -> float:
    """A number > 0 (seconds, fractions of a size, ...)."""
    v = _number(text, float)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def non_negative_float(text: str) -> float:
    """A finite number ≥ 0."""
    v = _number(text, float)
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number ≥ 0, got {text!r}")
    return v


def positive_int(text: str) -> int:
    """An integer ≥ 1."""
    v = _number(text, int)
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer ≥ 1, got {text!r}")
    return v


def port(text: str) -> int:
    """A TCP port, 0 (= pick a free one) to 65535."""
    v = _number(text, int)
    if not 0 <= v < 65536:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {text!r}")
    return v


def _number(text: str, kind: type) -> Any:
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
