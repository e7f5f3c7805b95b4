"""The serving table's old module path keeps importing, with a DeprecationWarning naming the
new one."""

from __future__ import annotations

import importlib
import sys

import pytest


def test_serving_table_old_path_imports_and_warns():
    sys.modules.pop("consumers.serving_table", None)
    with pytest.warns(DeprecationWarning, match=r"consumers\.serving\.table"):
        mod = importlib.import_module("consumers.serving_table")
    from consumers.serving.table import STORAGE_DTYPES, ServingTable

    assert mod.ServingTable is ServingTable and mod.STORAGE_DTYPES is STORAGE_DTYPES
