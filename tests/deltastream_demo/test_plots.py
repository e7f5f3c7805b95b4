"""deltastream_demo.plots: rates per second and axes that fit the steady state."""

from __future__ import annotations

import numpy as np
import pytest

from deltastream_demo.plots import per_second, plot_bound, plot_learning, plot_rates, steady_ylim
from deltastream_demo.report import PNG_MAGIC


def test_per_second_sums_each_second_and_fills_idle_seconds_with_zero():
    x, v = per_second([0.2, 0.7, 2.5], [10, 5, 4])
    assert x.tolist() == [0.0, 1.0, 2.0] and v.tolist() == [15.0, 0.0, 4.0]
    x, v = per_second([1.0, 1.4], [6, 2], bin_s=0.5)
    assert x.tolist() == [1.0] and v.tolist() == [16.0]  # 8 in half a second
    with pytest.raises(ValueError, match="same shape"):
        per_second([1.0], [1, 2])


def test_steady_ylim_keeps_a_lone_spike_off_the_scale():
    steady = np.r_[np.full(200, 100.0), [30_000.0]]  # the final flush's size
    assert 100.0 < steady_ylim(steady) < 200.0
    assert steady_ylim([], floor=5.0) == 5.0


def test_plots_are_pngs_with_and_without_data(tmp_path):
    publish = [[1, 0.5, 10, 800, 0], [2, 1.5, 12, 900, 0], [3, 1.6, 500, 40_000, 1]]
    timeline = {"loss": [[1, 0.7], [2, 0.6]], "auc": [[1, 0.5, 0.7, 0.69, 0]]}
    made = [plot_rates(tmp_path / "r.png", publish, budget_bytes_per_s=500.0, trainers=2),
            plot_rates(tmp_path / "r0.png", []),
            plot_learning(tmp_path / "l.png", timeline, {"trainer": 0.7, "serving": 0.7,
                                                         "ceiling": 0.9}, final_step=3),
            plot_learning(tmp_path / "l0.png", {}, {}),
            plot_bound(tmp_path / "b.png", [[1, 0.5, 0.4, 0], [2, 1.0, 0.3, 0],
                                            [3, 1.6, 0.0, 1]]),
            plot_bound(tmp_path / "b0.png", [])]
    for p in made:
        assert p is not None and p.read_bytes()[:8] == PNG_MAGIC
