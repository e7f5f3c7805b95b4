"""deltastream_demo.scoring: AUC, log loss, row tables and the numpy forward pass of the CTR model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltastream_demo.data import ClickStream, StreamConfig
from deltastream_demo.model import CTRModel, click_mlp, export_dense, local_tables
from deltastream_demo.scoring import (
    RowTable,
    auc,
    logloss,
    mlp_logits,
    score,
    weights_from_state_dict,
)

SMALL = StreamConfig(seed=3, n_users=2000, n_items=500)


def test_auc_matches_pairwise_definition_with_ties():
    rng = np.random.default_rng(0)
    y = (rng.random(600) < 0.3).astype(np.float32)
    s = np.round(rng.random(600) + 0.4 * y, 1)  # many ties
    pos, neg = s[y > 0], s[y == 0]
    expect = ((pos[:, None] > neg[None, :]).sum()
              + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (pos.size * neg.size)
    assert auc(y, s) == pytest.approx(expect, abs=1e-12)
    assert np.isnan(auc(np.ones(5), np.arange(5.0)))


def test_logloss_is_stable():
    assert logloss(np.array([1.0, 0.0]), np.array([100.0, -100.0])) == pytest.approx(0, abs=1e-9)
    assert logloss(np.array([1.0]), np.array([0.0])) == pytest.approx(np.log(2))


def test_row_table_lookup_and_missing_ids():
    t = RowTable.concat([(np.array([5, 1]), np.array([[5.0, 5], [1, 1]])),
                         (np.array([9]), np.array([[9.0, 9]]))], 2)
    np.testing.assert_array_equal(t.lookup(np.array([9, 7, 1])), [[9, 9], [0, 0], [1, 1]])
    np.testing.assert_array_equal(t.ids(), [1, 5, 9])
    np.testing.assert_array_equal(t.contains(np.array([1, 2])), [True, False])
    with pytest.raises(ValueError, match="unique"):
        RowTable(np.array([1, 1]), np.zeros((2, 2)))


def test_numpy_scoring_matches_the_torch_model():
    torch.manual_seed(0)
    s = ClickStream(SMALL)
    m = CTRModel(8, SMALL.n_dense, hidden=(16, 8), seed=0)
    b = s.batch(0, 512)
    m(torch.from_numpy(b.user_ids), torch.from_numpy(b.item_ids), torch.from_numpy(b.dense))
    m.eval()
    ev = s.batch(512, 300)  # includes ids the tables never saw (read as zeros both ways)
    with torch.no_grad():
        want = m(torch.from_numpy(ev.user_ids), torch.from_numpy(ev.item_ids),
                 torch.from_numpy(ev.dense)).numpy()
    tabs = local_tables(m)
    rows = {n: RowTable(t.ids().numpy(), t.embeddings().numpy()) for n, t in tabs.items()}
    got = score(export_dense(m), rows["user"].lookup, rows["item"].lookup, ev.user_ids,
                ev.item_ids, ev.dense)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="w0"):
        mlp_logits({"b0": np.zeros(1)}, np.zeros((1, 1)))


def test_streamed_state_dict_names_give_the_exported_mlp():
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = click_mlp(4, 2, (8, 5), torch.device("cpu"))

    net = Net()
    streamed = {k: v.detach().numpy() for k, v in net.state_dict().items()}
    w = weights_from_state_dict(streamed)
    linears = [m for m in net.mlp if isinstance(m, torch.nn.Linear)]
    assert sorted(w) == ["b0", "b1", "b2", "w0", "w1", "w2"]
    for i, lin in enumerate(linears):
        assert np.array_equal(w[f"w{i}"], lin.weight.detach().numpy())
        assert np.array_equal(w[f"b{i}"], lin.bias.detach().numpy())
    x = np.random.default_rng(0).standard_normal((7, 14)).astype(np.float32)
    with torch.no_grad():
        want = net.mlp(torch.from_numpy(x)).squeeze(1).numpy()
    assert np.allclose(mlp_logits(w, x), want, atol=1e-5)
    assert weights_from_state_dict({"other.weight": np.ones(3, np.float32)}) is None
