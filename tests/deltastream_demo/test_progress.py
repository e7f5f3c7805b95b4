"""deltastream_demo.progress: the live status line."""

from __future__ import annotations

import io

from deltastream_demo.progress import ProgressLine, fmt_rate, status_line


def test_progress_line_rewrites_in_place_and_pads_shorter_text():
    out = io.StringIO()
    p = ProgressLine(out, enabled=True)
    p.update("long text here", force=True)
    p.update("short", force=True)
    p.close()
    assert out.getvalue() == "\rlong text here\rshort         \n"


def test_progress_line_throttles_and_can_be_off():
    out = io.StringIO()
    p = ProgressLine(out, enabled=True)
    p.update("a")
    p.update("b")  # within 0.2 s of "a": skipped
    assert out.getvalue() == "\ra"
    off = io.StringIO()
    q = ProgressLine(off, enabled=False)
    q.update("x", force=True)
    q.close()
    assert off.getvalue() == ""


def test_status_line():
    assert fmt_rate(950) == "950" and fmt_rate(12_345) == "12.3K"
    line = status_line(elapsed=3.25, phase="training", step=40, steps=2400, loss=0.61234,
                       examples_per_s=30_000, rows_per_s=5_000, lag=3, fresh_p99=0.0981)
    assert line == ("[  3.2s] training step 40/2400  loss 0.6123  30.0K ex/s  pub 5.0K rows/s"
                    "  lag 3  fresh p99 98 ms")
    line = status_line(elapsed=1.0, phase="scoring", step=7, steps=None, loss=0.5,
                       examples_per_s=0, rows_per_s=0, lag=None, fresh_p99=None)
    assert "step 7/∞" in line and line.endswith("lag -  fresh p99 -")
