"""Deprecated module path: moved to :mod:`deltastream.tracking.tracker` (or import ``deltastream.DeltaTracker``).

Importing it still works and warns once (``DeprecationWarning`` naming the new path).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from deltastream.tracking.tracker import *  # noqa: F403
from deltastream.tracking.tracker import __all__  # noqa: F401

warnings.warn("deltastream.tracker is deprecated: import deltastream.tracking.tracker (or "
              "deltastream.DeltaTracker) instead", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    """Any other name of the new module (scripts may have used more than ``__all__``)."""
    return getattr(importlib.import_module("deltastream.tracking.tracker"), name)
