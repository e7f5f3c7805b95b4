"""Logging for the deltastream CLIs: one handler on stderr, kafka-python quiet, no secrets.

* kafka-python logs every connection attempt at INFO and every failed one at WARNING/ERROR
  (with tracebacks); the tools report broker trouble themselves in one line. So the
  ``kafka`` logger does not reach the terminal unless ``-v/--verbose``; its last
  warning or error is kept (:func:`last_kafka_error`) for the tools' one-line messages.
* The level is ``--log-level``, its variables, else the default of the command's kind
  (:data:`deltastream.cliargs.DEFAULT_LOG_LEVELS`: INFO for services, WARNING for one-shot
  tools); every CLI entry point sets it up with :func:`setup_cli_logging`.
* Secret values (SASL and key passwords) are replaced by ``***`` in every line any logger
  writes (:func:`setup_logging` ``secrets=``): kafka-python logs its whole configuration at
  DEBUG.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterable
from typing import Optional

from deltastream.cliargs import DEFAULT_LOG_LEVELS, SERVICE, chosen_log_level

__all__ = ["setup_cli_logging", "setup_logging", "last_kafka_error", "kafka_hint",
           "hide_secrets", "RedactSecrets"]

log = logging.getLogger(__name__)

DEFAULT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class RedactSecrets(logging.Filter):
    """Replaces each secret string by ``***`` in a record's formatted message."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.secrets: set[str] = {s for s in secrets if s}

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.secrets:
            return True
        text = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        hidden = text
        for s in self.secrets:
            hidden = hidden.replace(s, "***")
            if record.exc_text:
                record.exc_text = record.exc_text.replace(s, "***")
        if hidden != text:
            record.msg, record.args = hidden, None
        return True


class _KafkaTail(logging.Handler):
    """Keeps the last WARNING-or-worse message of kafka-python (secrets redacted)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.last: Optional[str] = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.last = record.getMessage().splitlines()[0][:300]
        except Exception:  # a bad log call in the library must not break the tool
            self.last = None


_redactor = RedactSecrets()
_tail = _KafkaTail()
_tail.addFilter(_redactor)


def hide_secrets(secrets: Iterable[str]) -> None:
    """Add ``secrets`` to the values replaced by ``***`` in every log line."""
    _redactor.secrets.update(s for s in secrets if s)


def last_kafka_error() -> Optional[str]:
    """The last warning or error kafka-python logged (hidden or not), or None."""
    return _tail.last


def kafka_hint(message: str) -> str:
    """``" (kafka: <last kafka-python complaint>)"`` when it adds something to ``message``
    (e.g. why SASL failed), else ``""``."""
    hint = _tail.last
    if not hint or "Unable to bootstrap" in hint or hint.rsplit(": ", 1)[-1] in message:
        return ""
    return f" (kafka: {hint})"


def setup_logging(level: Optional[str] = None, *, verbose: bool = False,
                  fmt: str = DEFAULT_FORMAT, secrets: Iterable[str] = ()) -> None:
    """Log to stderr at ``level`` (None: a service's, INFO); kafka-python's own lines only
    with ``verbose``. A CLI calls :func:`setup_cli_logging`.

    Idempotent: a second call replaces the handler it installed before.
    """
    hide_secrets(secrets)
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_deltastream", False):
            root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler._deltastream = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter(fmt))
    handler.addFilter(_redactor)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level or DEFAULT_LOG_LEVELS[SERVICE]))
    kafka = logging.getLogger("kafka")
    if _tail not in kafka.handlers:
        kafka.addHandler(_tail)
    if verbose:
        kafka.setLevel(logging.NOTSET)
        kafka.propagate = True
    else:
        # kept for last_kafka_error(); never printed
        kafka.setLevel(logging.WARNING)
        kafka.propagate = False


def setup_cli_logging(args: argparse.Namespace, *, fmt: str = DEFAULT_FORMAT,
                      secrets: Iterable[str] = ()) -> None:
    """:func:`setup_logging` for a CLI whose parser has
    :func:`deltastream.cliargs.add_logging_arguments`: the level given, else its kind's."""
    setup_logging(chosen_log_level(args), verbose=args.verbose, fmt=fmt, secrets=secrets)
