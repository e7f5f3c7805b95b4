"""Deprecated module path: moved to :mod:`deltastream.embedding.hashtable` (or import ``deltastream.HashTable``).

Importing it still works and warns once (``DeprecationWarning`` naming the new path).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from deltastream.embedding.hashtable import *  # noqa: F403
from deltastream.embedding.hashtable import __all__  # noqa: F401

warnings.warn("deltastream.hashtable is deprecated: import deltastream.embedding.hashtable (or "
              "deltastream.HashTable) instead", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    """Any other name of the new module (scripts may have used more than ``__all__``)."""
    return getattr(importlib.import_module("deltastream.embedding.hashtable"), name)
