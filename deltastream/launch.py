"""The console entry points: each loads its tool, then runs it.

A tool takes up to a second to load (numpy, kafka-python, the demo's flags); a Ctrl-C in
that second used to print an import-time traceback. Here it is one line, ``<prog>:
interrupted``, with the exit code a Ctrl-C gets later (130; 0 for a service, whose normal
stop is Ctrl-C). Only the standard library is imported here, so that the unguarded window
is the interpreter's own start.
"""

from __future__ import annotations

import importlib
import signal
import sys
from typing import Any

__all__ = ["launch", "deltastream"]


def launch(prog: str, target: str, *, service: bool = False) -> int:
    """Import ``target`` (``"package.module:function"``) and return what the function
    returns (an exit code); a Ctrl-C before it returns is one line on stderr and exit 130,
    or 0 for a ``service``."""
    caught: list[int] = []

    def on_ctrl_c(signum: int, frame: Any) -> None:
        caught.append(signum)
        signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt

    # Remembered because C code that is loading (numpy's) turns the KeyboardInterrupt into
    # an ImportError. Not installed where SIGINT is ignored (started in the background).
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, on_ctrl_c)
    module, _, function = target.partition(":")
    try:
        return int(getattr(importlib.import_module(module), function)() or 0)
    except SystemExit:
        raise
    except BaseException as e:
        if not (caught or isinstance(e, KeyboardInterrupt)):
            raise
        from deltastream.cliargs import EXIT_INTERRUPTED, EXIT_OK

        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_OK if service else EXIT_INTERRUPTED


def deltastream() -> int:
    """``deltastream`` (:func:`deltastream.cli.main`)."""
    return launch("deltastream", "deltastream.cli:main")
