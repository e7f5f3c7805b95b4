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

from deltastream.native_ext import NativeExtension

__all__ = ["NATIVE_AVAILABLE", "native", "native_enabled", "use_native"]

_EXT = NativeExtension("consumers.serving.native", "native lookup probe", "lookups use numpy")
#: the extension module, None when it is not built
native = _EXT.module
#: whether the C extension was built and imports
NATIVE_AVAILABLE = _EXT.available
#: whether tables run the native code now
native_enabled = _EXT.enabled
#: switch tables to the native code (``RuntimeError`` when it is not built) or to numpy
use_native = _EXT.use
