"""Deprecated module path: moved to :mod:`consumers.serving.table` (or import
``consumers.ServingTable``).

Importing it still works and warns once (``DeprecationWarning`` naming the new path).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from consumers.serving.table import *  # noqa: F403
from consumers.serving.table import __all__  # noqa: F401

warnings.warn("consumers.serving_table is deprecated: import consumers.serving.table (or "
              "consumers.ServingTable) instead", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    """Any other name of the new module (scripts may have used more than ``__all__``)."""
    return getattr(importlib.import_module("consumers.serving.table"), name)
