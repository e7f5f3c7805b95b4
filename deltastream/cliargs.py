"""argparse conventions shared by every deltastream CLI (torch-free).

* **Environment variables.** Every flag also reads an environment variable named after the
  tool: ``--state-dir`` of ``deltastream-sync`` reads ``DELTASTREAM_SYNC_STATE_DIR``; a
  subcommand adds its name (``deltastream-replay dump --limit`` reads
  ``DELTASTREAM_REPLAY_DUMP_LIMIT``, then the tool-wide ``DELTASTREAM_REPLAY_LIMIT``). Only
  truly shared settings also read a shared name, last: ``DELTASTREAM_BOOTSTRAP_SERVERS``,
  ``DELTASTREAM_KAFKA_CONFIG`` (and the ``DELTASTREAM_KAFKA_*`` security variables of
  :mod:`deltastream.kafka_config`), ``DELTASTREAM_LOG_LEVEL``. The command line wins, then
  the most specific variable. ``--help`` names each flag's variables.
* **Errors.** A bad flag or variable value is one line on stderr naming it and what was
  expected, exit code 2 (:data:`EXIT_USAGE`). The exit codes of all tools are in
  :data:`EXIT_CODES`.
* **Value types** for flags (:func:`positive_int`, :func:`bootstrap_servers`, …) raise
  ``ArgumentTypeError``, so a bad value is a usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn, Optional

from deltastream.kafka_config import check_bootstrap_servers, security_config

__all__ = ["EnvArgumentParser", "ListAction", "env_name", "positive_float",
           "non_negative_float", "positive_int", "port", "bootstrap_servers", "comma_list",
           "existing_dir", "option", "fields_doc", "add_field_flags", "field_values",
           "add_kafka_arguments", "kafka_settings", "add_logging_arguments", "EXIT_OK",
           "EXIT_FAILED", "EXIT_USAGE", "EXIT_UNAVAILABLE", "EXIT_INTERRUPTED", "EXIT_CODES",
           "SHARED_FLAGS", "DEFAULT_MODEL", "BROKER_TIMEOUT_S", "suggest_flags",
           "subcommand_parser",
           "first_sentence", "SERVICE", "ONE_SHOT", "DEFAULT_LOG_LEVELS", "LOG_LEVELS",
           "VERBOSE_LOG_LEVEL", "chosen_log_level"]

ENV_PREFIX = "DELTASTREAM_"

#: flags that every tool shares; they also read ``DELTASTREAM_<FLAG>`` (after the tool's own)
SHARED_FLAGS = frozenset({"bootstrap-servers", "kafka-config", "log-level"})

# The exit codes of every deltastream tool (README "Exit codes").
EXIT_OK = 0           #: success (diff: no differences; services: stopped by SIGTERM/SIGINT)
EXIT_FAILED = 1       #: ran, and found a problem: a diff, a broken invariant, a failed run
EXIT_USAGE = 2        #: usage or input error: flags, variables, files, snapshots, state
EXIT_UNAVAILABLE = 3  #: the broker or the topic is unavailable (unreachable, TLS/SASL, missing)
EXIT_INTERRUPTED = 130  #: interrupted (Ctrl-C) before finishing; one-shot tools only

#: one line for ``--help`` epilogs
EXIT_CODES = ("exit codes: 0 ok, 1 a problem found (diff, broken invariant, failed run), "
              "2 usage or input error, 3 broker or topic unavailable, 130 interrupted")


def env_name(dest: str, prefix: str = ENV_PREFIX) -> str:
    """Environment variable of a flag: ``state-dir`` -> ``<prefix>STATE_DIR``."""
    return prefix + dest.upper().replace("-", "_")


_RST = [(re.compile(r":[a-z]+:`~?([^`]+)`"), r"\1"), (re.compile(r"``([^`]+)``"), r"\1")]


def _plain(text: str) -> str:
    """Docstring markup (``x``, :mod:`x`) as plain text for a terminal."""
    for pattern, repl in _RST:
        text = pattern.sub(repl, text)
    return text


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown only where they say something (not on required flags, not None or
    False), and no reStructuredText markup in descriptions."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (action.required or default is None or default is argparse.SUPPRESS
                or isinstance(default, bool) or default == [] or "%(default)" in text
                or not action.option_strings):
            return text
        return text + " (default: %(default)s)"

    def _format_text(self, text: str) -> str:
        return super()._format_text(_plain(text))

    def _expand_help(self, action: argparse.Action) -> str:
        return _plain(super()._expand_help(action))


class EnvDefault:
    """A flag's default taken from environment variable ``var`` (text ``raw``), converted
    when its parser runs and the command line leaves the flag out."""

    __slots__ = ("var", "raw")

    def __init__(self, var: str, raw: str) -> None:
        self.var, self.raw = var, raw

    def __str__(self) -> str:
        return self.raw

    def __repr__(self) -> str:
        return repr(self.raw)


#: seconds a one-shot tool (``deltastream topic``, ``deltastream-replay``) waits for the
#: broker to answer before exit 3; the sync daemon never gives up (its --request-timeout is
#: per request, --startup-timeout an overall deadline)
BROKER_TIMEOUT_S = 30.0

#: kinds of command, for their default ``--log-level`` (:data:`DEFAULT_LOG_LEVELS`)
SERVICE, ONE_SHOT = "service", "one-shot"

#: the default log level of each kind of command (README "Logging"). A service (the sync
#: daemon, the broker, the demo) runs for minutes to months: its INFO lines (started, caught
#: up, periodic summaries, stopping) are the operator's record of it. A one-shot tool
#: (``deltastream-replay``, ``topic``, ``bench``) answers on stdout, so what it writes on
#: stderr should be only what went wrong.
DEFAULT_LOG_LEVELS = {SERVICE: "INFO", ONE_SHOT: "WARNING"}

#: the ``--log-level`` choices, most verbose first
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

#: the level ``-v`` lowers a command's default to: ``-v`` asks for kafka-python's own lines,
#: and it logs its connections at INFO
VERBOSE_LOG_LEVEL = "INFO"

#: model name of the one-shot tools that need one (``deltastream topic``, ``demo``): the
#: same, so ``deltastream topic`` makes the topic the demo then uses (``deltas.demo``)
DEFAULT_MODEL = "demo"


def first_sentence(text: str) -> str:
    """``text`` up to its first sentence end (a ``.`` before a capital: not ``e.g. x``),
    for a short ``--help``."""
    return re.split(r"(?<=\.)(?<!e\.g\.)(?<!i\.e\.)\s+(?=[A-Z(])", text, maxsplit=1)[0]


class _HelpEnv(argparse.Action):
    """``--help-env``: each flag and the variables it reads, most specific first."""

    def __call__(self, parser: Any, namespace: Any, values: Any,
                 option_string: Optional[str] = None) -> None:
        width = max((len(f) for f, _ in parser.env_table), default=0) + 2
        lines = [f"{f:<{width}}{', else '.join(v)}" for f, v in parser.env_table]
        sys.stdout.write("environment variables (the command line wins):\n"
                         + "\n".join(lines) + "\n")
        parser.exit(0)


def subcommand_parser(parser: argparse.ArgumentParser,
                      argv: Sequence[str]) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``argv`` runs: ``parser``, or the (sub)subcommand
    named in ``argv``."""
    p = parser
    for tok in argv:  # walk down to the subcommand named in argv
        sub = next((a for a in p._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is not None and tok in sub.choices:
            p = sub.choices[tok]
    return p


def suggest_flags(parser: argparse.ArgumentParser, argv: Sequence[str],
                  unknown: Sequence[str]) -> str:
    """`` (did you mean --x?)`` for the unknown ``--flags`` close to a flag of the
    (sub)command ``argv`` runs, else ``""``."""
    import difflib

    p = subcommand_parser(parser, argv)
    known = [o for a in p._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for tok in unknown:
        name = tok.split("=", 1)[0]
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.7) \
            if name.startswith("--") else []
        hints += [(close[0], name)] if close else []
    if len(hints) == 1:
        return f" (did you mean {hints[0][0]}?)"
    return f" (did you mean {', '.join(f'{c} for {n}' for c, n in hints)}?)" if hints else ""


class EnvArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose optional flags default from environment variables.

    Args:
        env_prefix: this parser's prefix, e.g. ``"DELTASTREAM_SYNC_"``.
        env_parent: a second prefix read after ``env_prefix`` (a subcommand's tool-wide
            prefix, e.g. ``"DELTASTREAM_REPLAY_"``).

    ``add_argument`` takes two extra keywords: ``env_local=True`` reads only
    ``env_prefix`` (a flag whose meaning differs between subcommands, like ``--out``);
    ``env=False`` reads no variable. Values from the environment go through the flag's
    ``type`` and ``choices``; ``store_true`` flags accept 1/true/yes/on and 0/false/no/off.
    Subparsers (``add_subparsers().add_parser(name, env_prefix=…)``) are of this class too.
    """

    def __init__(self, *args: Any, env_prefix: str = ENV_PREFIX,
                 env_parent: Optional[str] = None, brief: bool = False,
                 **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.env_prefix = env_prefix
        self.env_parent = env_parent
        # brief: --help gives each flag its first sentence, the variables are behind
        # --help-env (a tool with many flags: deltastream-sync)
        self.brief = brief
        self.env_table: list[tuple[str, list[str]]] = []
        if brief:
            super().add_argument("--help-env", action=_HelpEnv, nargs=0,
                                 help="show the environment variable of each flag and exit")

    def error(self, message: str) -> NoReturn:
        """A usage error: one line on stderr, exit code 2."""
        missing = "the following arguments are required: "
        flags = message[len(missing):].split(", ")
        if message.startswith(missing) and all(f.startswith("--") for f in flags):
            # say where else the values may come from
            message += " (or set " + ", ".join(self.env_vars(f[2:])[-1] for f in flags) + ")"
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args: Optional[Sequence[str]] = None,  # type: ignore[override]
                   namespace: Optional[argparse.Namespace] = None) -> argparse.Namespace:
        """``argparse``'s, with a suggestion for a misspelt flag (``stats --shards 0``:
        did you mean --shard?)."""
        argv = list(sys.argv[1:] if args is None else args)
        ns, extras = self.parse_known_args(argv, namespace)
        if extras:  # the subcommand's error: its name, its --help
            subcommand_parser(self, argv).error(f"unrecognized arguments: {' '.join(extras)}"
                                                f"{suggest_flags(self, argv, extras)}")
        return ns

    def env_vars(self, flag: str, *, local: bool = False) -> list[str]:
        """The variables of ``flag`` (``"state-dir"``), most specific first."""
        out = [env_name(flag, self.env_prefix)]
        if self.env_parent and not local:
            out.append(env_name(flag, self.env_parent))
        if flag in SHARED_FLAGS:
            out.append(env_name(flag))
        return list(dict.fromkeys(out))

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        local = kwargs.pop("env_local", False)
        use_env = kwargs.pop("env", True)
        action = super().add_argument(*args, **kwargs)
        if not use_env or not action.option_strings or action.dest in ("help", "version"):
            return action
        # Named after the long flag, not the dest: `--model` (dest model_name) reads
        # ..._MODEL, which is what a user reading --help expects.
        longs = [o for o in action.option_strings if o.startswith("--")]
        names = self.env_vars(longs[0][2:] if longs else action.dest, local=local)
        if self.brief:
            self.env_table.append((longs[0] if longs else action.dest, names))
            action.help = first_sentence(action.help or "")
        else:
            action.help = (action.help or "") + " [env " + ", else ".join(names) + "]"
        var = next((n for n in names if n in os.environ), None)
        if var is None:
            return action
        # converted only if this parser runs and the command line does not give the flag
        # (parse_known_args): a bad variable of another subcommand is none of this one's
        # business, and the command line wins
        action.default = EnvDefault(var, os.environ[var])
        action.required = False
        return action

    def parse_known_args(self, args: Optional[Sequence[str]] = None,
                         namespace: Optional[argparse.Namespace] = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        """argparse's, then the values of flags left to their environment variable are
        converted (a bad one is a usage error of this parser, naming the variable)."""
        ns, rest = super().parse_known_args(args, namespace)
        for action in self._actions:
            value = getattr(ns, action.dest, None)
            if isinstance(value, EnvDefault):
                setattr(ns, action.dest, self._from_env(action, value))
        return ns, rest

    def _from_env(self, action: argparse.Action, env: EnvDefault) -> Any:
        var, raw = env.var, env.raw
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            truth = raw.strip().lower()
            if truth not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                self.error(f"{var}={raw!r}: expected 1/true/yes/on or 0/false/no/off")
            on = truth in ("1", "true", "yes", "on")
            return on if isinstance(action, argparse._StoreTrueAction) else not on
        return self._convert(action, raw, var)

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


class ListAction(argparse.Action):
    """A flag that takes a comma-separated list and may be repeated: the values add up.

    ``type`` turns one flag value into a list. A default (e.g. from the environment) is
    replaced, not extended, by the first use on the command line.
    """

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: Optional[str] = None) -> None:
        current = getattr(namespace, self.dest, None)
        if current is self.default or current is None:
            current = []
        setattr(namespace, self.dest, list(current) + list(values))


# --------------------------------------------------------------------------- value types
# They raise ArgumentTypeError, so a bad value on the command line or in a variable is a
# usage error (exit 2) naming the flag or the variable.


def positive_float(text: str) -> float:
    """A number > 0 (seconds, fractions of a size, ...)."""
    v = _number(text, float)
    if not 0 < v < float("inf"):
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


def bootstrap_servers(text: str) -> str:
    """``host:port[,host:port…]``, port 1..65535, IPv6 in brackets (see
    :func:`deltastream.kafka_config.check_bootstrap_servers`)."""
    try:
        return str(check_bootstrap_servers(text.strip()))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def comma_list(text: str) -> list[str]:
    """``"a,b"`` -> ``["a", "b"]`` (empty items dropped; at least one)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected one or more comma-separated values, got "
                                         f"{text!r}")
    return items


def existing_dir(text: str) -> str:
    """The path of a directory that exists (one this tool uses, never creates)."""
    if not text or not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected an existing directory, got {text!r}")
    return text


def _number(text: str, kind: type) -> Any:
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


# --------------------------------------------------------------------------- settings flags


def option(default: Any = dataclasses.MISSING, help: str = "", *,
           flag: Optional[dict] = None, factory: Any = dataclasses.MISSING) -> Any:
    """A settings dataclass field spelled once: its ``default`` (or ``factory``), its
    ``help`` (for the class docstring, :func:`fields_doc`, and ``--help``) and ``flag``: the
    argparse keywords of its command-line flag, plus ``name`` when the flag is not
    ``--<field-name>`` (None: not a flag)."""
    return dataclasses.field(default=default, default_factory=factory,
                             metadata={"help": help, "flag": flag})


def fields_doc(settings: type) -> str:
    """A docstring section listing each field of ``settings`` with its help."""
    lines = ["", "    Fields:"]
    lines += [f"        {f.name}: {f.metadata['help']}" for f in dataclasses.fields(settings)
              if f.metadata.get("help")]
    return "\n".join(lines) + "\n"


def _flag_fields(settings: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(settings) if f.metadata.get("flag") is not None]


def add_field_flags(parser: argparse.ArgumentParser, settings: type,
                    helps: Optional[Mapping[str, str]] = None) -> None:
    """One ``--flag`` per field of the dataclass ``settings`` that has ``flag`` metadata
    (argparse keywords; see :func:`option`) and ``help`` metadata: flag ``--a-b`` for field
    ``a_b`` unless ``flag`` names it, the field's default unless ``flag`` gives one.
    ``helps``: ``{field: help}`` for fields whose flag means something else on this
    parser (a subcommand's variant of a shared flag)."""
    for f in _flag_fields(settings):
        kw = dict(f.metadata["flag"])
        name = kw.pop("name", "--" + f.name.replace("_", "-"))
        if "default" not in kw and not kw.get("required") and kw.get("action") != "store_true":
            kw["default"] = None if f.default is dataclasses.MISSING else f.default
        help_text = (helps or {}).get(f.name, f.metadata.get("help"))
        parser.add_argument(name, dest=f.name, help=help_text, **kw)


def field_values(args: argparse.Namespace, settings: type) -> dict[str, Any]:
    """``{field: value}`` of the flags :func:`add_field_flags` made for ``settings``
    (keywords for that dataclass)."""
    return {f.name: getattr(args, f.name) for f in _flag_fields(settings)}


# --------------------------------------------------------------------------- shared flags


def add_kafka_arguments(parser: EnvArgumentParser, *, required: bool = True,
                        help_suffix: str = "") -> None:
    """``--bootstrap-servers`` (validated) and ``--kafka-config FILE`` (TLS/SASL)."""
    parser.add_argument("--bootstrap-servers", type=bootstrap_servers, required=required,
                        default=None, metavar="HOST:PORT[,...]",
                        help="Kafka bootstrap servers." + help_suffix)
    parser.add_argument("--kafka-config", default=None, metavar="FILE",
                        help="Kafka client security settings (TLS, SASL) as key=value lines, "
                             "e.g. security.protocol=SASL_SSL, sasl.mechanism=SCRAM-SHA-512, "
                             "sasl.username=…, ssl.cafile=…; each also from a "
                             "DELTASTREAM_KAFKA_<NAME> variable (e.g. "
                             "DELTASTREAM_KAFKA_SASL_PASSWORD), which wins over the file. "
                             "Secrets never need the command line.")


def kafka_settings(args: argparse.Namespace, parser: argparse.ArgumentParser,
                   tool_prefix: str) -> dict[str, Any]:
    """The validated security settings of ``--kafka-config`` and the environment
    (``<tool_prefix>KAFKA_*`` before ``DELTASTREAM_KAFKA_*``); a bad one is a usage error."""
    try:
        return security_config(getattr(args, "kafka_config", None),
                               prefixes=tuple(dict.fromkeys((tool_prefix, ENV_PREFIX))))
    except ValueError as e:
        parser.error(str(e))


def add_logging_arguments(parser: EnvArgumentParser, *, kind: Optional[str] = SERVICE,
                          again: Optional[EnvArgumentParser] = None) -> None:
    """``--log-level`` and ``-v/--verbose``; without a level given (flag or variable) the
    command logs at its ``kind``'s (:data:`DEFAULT_LOG_LEVELS`; None: a parent whose
    subcommands each have their own). ``again``: the parent parser, whose same flags these
    repeat on a subcommand (they override the ones given before it; the variables are the
    parent's). Read the level with :func:`chosen_log_level`."""
    level = DEFAULT_LOG_LEVELS[kind] if kind else None
    if level:
        parser.set_defaults(log_level_default=level)
    kw: dict[str, Any] = ({"default": argparse.SUPPRESS, "env": False} if again
                          else {"default": None})
    if level:
        lowered = f", {VERBOSE_LOG_LEVEL} with -v" if _above(level, VERBOSE_LOG_LEVEL) else ""
        why = f" (default for this command: {level}{lowered})"
    else:
        why = (f" (default: the subcommand's, see its --help: {DEFAULT_LOG_LEVELS[SERVICE]} "
               f"for services, {DEFAULT_LOG_LEVELS[ONE_SHOT]} for one-shot tools)")
    where = (" Also accepted before the subcommand [env "
             + ", else ".join(again.env_vars("log-level")) + "]." if again else "")
    parser.add_argument("--log-level", choices=LOG_LEVELS,
                        help="Logging level, on stderr" + why + "." + where, **kw)
    kw_v: dict[str, Any] = ({"default": argparse.SUPPRESS, "env": False} if again else {})
    where_v = (" Also accepted before the subcommand [env "
               + ", else ".join(again.env_vars("verbose")) + "]." if again else "")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="Also show the Kafka client library's (kafka-python) own log "
                             "lines; they are hidden otherwise, and failures are reported "
                             "in one line." + where_v, **kw_v)


def chosen_log_level(args: argparse.Namespace) -> str:
    """The level of ``--log-level`` (or its variables), else the default of the command's
    kind set by :func:`add_logging_arguments`, at most :data:`VERBOSE_LOG_LEVEL` with
    ``-v``."""
    if args.log_level:
        return args.log_level
    level = getattr(args, "log_level_default", None) or DEFAULT_LOG_LEVELS[SERVICE]
    if getattr(args, "verbose", False) and _above(level, VERBOSE_LOG_LEVEL):
        return VERBOSE_LOG_LEVEL
    return level


def _above(level: str, other: str) -> bool:
    """Whether ``level`` is less verbose than ``other`` (WARNING above INFO)."""
    return LOG_LEVELS.index(level) > LOG_LEVELS.index(other)
