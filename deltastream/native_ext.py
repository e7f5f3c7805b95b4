"""An optional C extension, loaded once, and the process-wide switch between it and numpy.

The C extensions (the HashTable index's :mod:`deltastream.embedding.native`, the tracker's
:mod:`deltastream.tracking.native`, the budget worker's :mod:`deltastream.publishing.native`
and the serving table's :mod:`consumers.serving.native`) are built at install when a C
compiler is there (``setup.py``). Without one, or with ``DELTASTREAM_NATIVE=0`` in the
environment, or after :meth:`NativeExtension.use` ``(False)``, their callers run numpy or
torch code with the same results.
Torch-free: the predictor side uses it too.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType
from typing import Optional

__all__ = ["NativeExtension", "ENV"]

log = logging.getLogger(__name__)

#: the environment variable that turns every C extension off (``0``)
ENV = "DELTASTREAM_NATIVE"


class NativeExtension:
    """The C extension ``name`` (``module`` None when it does not import) and whether its
    code runs now. ``what`` names it in the log lines and errors (``"native lookup probe"``);
    ``fallback`` says what runs without it (``"lookups use numpy"``)."""

    def __init__(self, name: str, what: str, fallback: str) -> None:
        self.name, self.what = name, what
        self.module: Optional[ModuleType]
        try:
            self.module = importlib.import_module(name)
        except ImportError as e:  # not built (no compiler at install): numpy it is
            self.module, self.why = None, str(e)
        else:
            self.why = ""
        self._use = self.available and os.environ.get(ENV, "1") != "0"
        if not self.available:
            log.info("%s unavailable (%s): %s", what, self.why, fallback)
        elif not self._use:
            log.info("%s disabled by %s=0: %s", what, ENV, fallback)

    @property
    def available(self) -> bool:
        """Whether the extension was built and imports."""
        return self.module is not None

    def enabled(self) -> bool:
        """Whether the C code runs now."""
        return self._use

    def use(self, on: bool) -> None:
        """Switch to the C code (``on``; ``RuntimeError`` when it is not built) or to numpy.
        Process-wide; meant for tests and benchmarks."""
        if on and not self.available:
            raise RuntimeError(f"the {self.what} ({self.name}) is not built ({self.why})")
        self._use = bool(on)
