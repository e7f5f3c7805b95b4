"""Whether a serving table's C code runs: the optional extension, loaded once, and the
process-wide switch between it and numpy.

The extension :mod:`consumers.serving.native` is built from ``native.c`` (arguments),
``native_loops.c`` (the loops) and ``native_warm.c`` (a reader's page warmer) at install
when a C compiler is there (``setup.py``). It runs both sides of a table: the read path
(:mod:`consumers.serving.lookup`) and the writer's index probes and inserts
(:class:`consumers.serving.id_index.IdIndex`), which it runs without the GIL, so reader threads of
the daemon's process never wait for a batch's index work; and the page warmer of a reader
process (:mod:`consumers.serving.reader`), whose loop it runs without the GIL too. Without
it (or with ``DELTASTREAM_NATIVE=0`` in the environment, or after :func:`use_native(False)
<use_native>`) all of it runs numpy or Python code with the same results.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Optional

__all__ = ["NATIVE_AVAILABLE", "native", "native_enabled", "use_native"]

log = logging.getLogger(__name__)

native: Optional[ModuleType]
try:
    from consumers.serving import native
except ImportError as e:  # not built (no compiler at install): numpy it is
    native = None
    _WHY = str(e)
else:
    _WHY = ""

#: whether the C extension was built and imports
NATIVE_AVAILABLE = native is not None

_use = NATIVE_AVAILABLE and os.environ.get("DELTASTREAM_NATIVE", "1") != "0"
if not NATIVE_AVAILABLE:
    log.info("native lookup probe unavailable (%s): lookups use numpy", _WHY)
elif not _use:
    log.info("native lookup probe disabled by DELTASTREAM_NATIVE=0: lookups use numpy")


def native_enabled() -> bool:
    """Whether tables run the native code now."""
    return _use


def use_native(on: bool) -> None:
    """Switch tables to the native code (``on``; ``RuntimeError`` when it is not built)
    or to numpy. Process-wide; meant for tests and benchmarks."""
    global _use
    if on and not NATIVE_AVAILABLE:
        raise RuntimeError(f"the native lookup probe is not built ({_WHY})")
    _use = bool(on)
