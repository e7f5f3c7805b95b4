"""Deprecated module path: moved to :mod:`deltastream.tracking.path_choice` (it holds the
rules that choose how a table's changes are found, not file paths).

Importing it still works and warns once (``DeprecationWarning`` naming the new path).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from deltastream.tracking.path_choice import *  # noqa: F403
from deltastream.tracking.path_choice import __all__  # noqa: F401

warnings.warn("deltastream.tracking.paths is deprecated: import "
              "deltastream.tracking.path_choice instead", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    """Any other name of the new module (scripts may have used more than ``__all__``)."""
    return getattr(importlib.import_module("deltastream.tracking.path_choice"), name)
