"""Module paths that moved keep importing, with a DeprecationWarning naming the new path."""

from __future__ import annotations

import importlib
import sys

import pytest


@pytest.mark.parametrize("old,new,name", [
    ("deltastream.hashtable", "deltastream.embedding.hashtable", "HashTable"),
    ("deltastream.tracker", "deltastream.tracking.tracker", "DeltaTracker"),
    ("deltastream.store", "deltastream.tracking.store", "DeltaStore"),
    ("deltastream.tracking.paths", "deltastream.tracking.path_choice", "sparse_only_reason"),
])
def test_old_path_imports_and_warns(old, new, name):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        mod = importlib.import_module(old)
    assert getattr(mod, name) is getattr(importlib.import_module(new), name)
    assert set(mod.__all__) == set(importlib.import_module(new).__all__)
