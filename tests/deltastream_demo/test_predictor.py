"""deltastream_demo.predictor: serving-vs-trainer row comparison within the wire dtype's rounding."""

from __future__ import annotations

import numpy as np

from deltastream_demo.predictor import compare_rows, row_tolerance
from deltastream_demo.scoring import RowTable


def test_row_tolerance_and_compare_rows():
    from consumers import ServingTable

    rng = np.random.default_rng(1)
    ids = np.arange(50, dtype=np.int64)
    rows = rng.normal(size=(50, 4)).astype(np.float32)
    trainer = RowTable(ids, rows)
    serving = ServingTable.from_arrays("t", ids[:40], rows[:40].astype(np.float16)
                                       .astype(np.float32))
    c = compare_rows(ids, serving, trainer, "f16")
    assert c["ids_compared"] == 40 and c["missing_in_serving"] == 10
    assert c["violations"] == 0 and 0 < c["max_abs"] <= c["tolerance"]
    assert row_tolerance(rows, "f32").max() == 0
    # a wrong row is caught
    serving.upsert(ids[:1], rows[:1] + 0.1)
    assert compare_rows(ids, serving, trainer, "f16")["violations"] > 0
