"""DensePublisher's logic: which tensors a version carries, change detection, cadence, full
versions every N, deferral while the worker is busy, one publishing rank. The publisher is
a recorder of publish_dense calls (pure logic); the broker path is in
tests/integration/test_dense_publish.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from deltastream import DeltaTracker, TrackingMode
from deltastream.publishing.dense import DenseOptions, DensePublisher
from deltastream.publishing.dense_snapshot import ChangeFilter, DenseCopier, dense_entries


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.mlp = torch.nn.Linear(4, 3)
        self.bn = torch.nn.BatchNorm1d(3)
        self.frozen = torch.nn.Linear(3, 1)


class Recorder:
    """Records publish_dense calls as (step, base_step, {name: copy}); ``gate`` holds them."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, object, dict]] = []
        self.gate = threading.Event()
        self.gate.set()

    def publish_dense(self, tensors, *, step, base_step=None, ts=None, dtype="f32"):
        self.gate.wait(10)
        self.calls.append((step, base_step, {k: np.array(v) for k, v in tensors.items()}))
        return type("R", (), {"messages": len(tensors), "bytes": 0})()


def _train(model: Model, step: int) -> None:
    """A change of mlp.weight (always) and bn.running_mean (every other step)."""
    with torch.no_grad():
        model.mlp.weight.add_(0.1)
        if step % 2 == 0:
            model.bn.running_mean.add_(1.0)


def test_entries_leave_out_the_tracked_tables_and_integer_buffers():
    model = Model()
    tracker = DeltaTracker(model, mode=TrackingMode.EMBEDDING)
    got = dense_entries(model, exclude=tuple(tracker.get_tracked_modules()))
    assert "emb.weight" not in got and "bn.num_batches_tracked" not in got
    assert set(got) == {"mlp.weight", "mlp.bias", "bn.weight", "bn.bias", "bn.running_mean",
                        "bn.running_var", "frozen.weight", "frozen.bias"}
    assert set(dense_entries(model, names=("mlp.bias",))) == {"mlp.bias"}
    with pytest.raises(KeyError, match="nope"):
        dense_entries(model, names=("nope",))
    with pytest.raises(TypeError, match="num_batches_tracked"):
        dense_entries(model, names=("bn.num_batches_tracked",))


def test_the_copy_is_a_snapshot_in_reused_buffers():
    model = Model()
    copier = DenseCopier()
    first, ready = copier.copy(dense_entries(model))
    assert ready is None  # host tensors: nothing to wait for
    before = first["mlp.weight"].clone()
    _train(model, 0)
    np.testing.assert_array_equal(first["mlp.weight"], before)  # the copy, not the live one
    second, _ = copier.copy(dense_entries(model))
    assert second["mlp.weight"].data_ptr() == first["mlp.weight"].data_ptr()
    torch.testing.assert_close(second["mlp.weight"], model.mlp.weight.detach())


def test_change_filter_keeps_only_what_differs_from_the_last_sent():
    f = ChangeFilter()
    a = {"x": np.ones(3, np.float32), "y": np.array([np.nan], np.float32)}
    assert set(f.changed(a)) == {"x", "y"}
    f.sent(a)
    a["x"][0] = 5  # the buffer is reused: what was sent must have been copied
    assert set(f.changed(a)) == {"x"}  # NaN equals NaN
    assert set(f.changed({"x": np.ones(4, np.float32)})) == {"x"}  # shape change
    f.reset()
    assert set(f.changed(a)) == {"x", "y"}


def _run(options: DenseOptions, steps: int) -> tuple[Recorder, DensePublisher, Model]:
    model, rec = Model(), Recorder()
    with DensePublisher(rec, model, options) as dense:
        for step in range(1, steps + 1):
            _train(model, step)
            dense.tick(step)
            dense.wait(10)
    return rec, dense, model


@pytest.mark.parametrize("threaded", [False, True])
def test_cadence_partial_versions_and_a_full_one_every_n(threaded):
    rec, dense, model = _run(DenseOptions(every_steps=2, full_every=3, threaded=threaded), 12)
    steps = [c[0] for c in rec.calls]
    assert steps == [1, 3, 5, 7, 9, 11]
    bases = [c[1] for c in rec.calls]
    assert bases == [None, 1, 3, None, 7, 9]  # full, then partials on the previous version
    everything = set(dense_entries(model))
    for _, base, tensors in rec.calls:
        if base is None:
            assert set(tensors) == everything
        else:  # odd steps: bn.running_mean moved at the even step in between
            assert set(tensors) == {"mlp.weight", "bn.running_mean"}
    np.testing.assert_allclose(rec.calls[-1][2]["mlp.weight"],
                               model.mlp.weight.detach().numpy() - 0.1, rtol=1e-6)
    st = dense.stats()
    assert (st["versions"], st["full_versions"], st["deferred"]) == (6, 2, 0)
    assert st["copy_ms"]["max"] > 0


def test_cadence_in_seconds_and_a_wrapped_model():
    model, rec, now = Model(), Recorder(), [0.0]
    wrapped = torch.nn.DataParallel(model)  # its state_dict keys start with "module."
    dense = DensePublisher(rec, wrapped, DenseOptions(every_steps=None, every_s=2.0,
                                                      threaded=False), clock=lambda: now[0])
    for step in range(1, 8):
        now[0] += 0.75
        _train(model, step)
        dense.tick(step)
    # first at once, then each time 2 s have passed since the last version: 0.75, 3.0, 5.25
    assert [c[0] for c in rec.calls] == [1, 4, 7]
    assert "mlp.weight" in rec.calls[0][2]


def test_unchanged_weights_send_nothing_and_flush_sends_a_full_version():
    model, rec = Model(), Recorder()
    dense = DensePublisher(rec, model, DenseOptions(every_steps=1, threaded=False))
    dense.tick(1)
    dense.tick(2)  # nothing trained: no version
    assert [c[0] for c in rec.calls] == [1] and dense.stats()["unchanged"] == 1
    dense.flush(3)
    assert rec.calls[-1][:2] == (3, None) and set(rec.calls[-1][2]) == set(dense_entries(model))


def test_a_due_version_waits_while_the_worker_is_busy():
    model, rec = Model(), Recorder()
    rec.gate.clear()
    with DensePublisher(rec, model, DenseOptions(every_steps=1)) as dense:
        dense.tick(1)
        dense.tick(2)  # the worker holds version 1 (or it waits in the slot): deferred
        assert dense.stats()["deferred"] == 1
        rec.gate.set()
        dense.wait(10)
        _train(model, 3)
        dense.tick(3)
        dense.wait(10)
    assert [c[0] for c in rec.calls] == [1, 3]
    _train(model, 4)
    with pytest.raises(RuntimeError, match="closed"):  # not a version no worker will send
        dense.tick(4)


def test_a_failed_version_is_raised_by_the_next_tick_and_the_next_version_is_full():
    model, rec = Model(), Recorder()
    fail = [True]

    def publish_dense(tensors, **kw):
        if fail.pop(0) if fail else False:
            raise RuntimeError("broker down")
        return Recorder.publish_dense(rec, tensors, **kw)

    rec.publish_dense = publish_dense
    with DensePublisher(rec, model, DenseOptions(every_steps=1, full_every=100)) as dense:
        dense.tick(1)
        dense.wait(10)
        _train(model, 2)
        with pytest.raises(RuntimeError, match="broker down"):
            dense.tick(2)
        dense.tick(3)
        dense.wait(10)
    assert [(c[0], c[1]) for c in rec.calls] == [(3, None)]


def test_only_the_chosen_rank_publishes(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    rec = Recorder()
    for rank, calls in ((0, 0), (1, 1)):
        dense = DensePublisher(rec, Model(), DenseOptions(rank=rank, threaded=False))
        dense.tick(1)
        dense.flush(2)
        assert len(rec.calls) == 2 * calls
        rec.calls.clear()


@pytest.mark.parametrize("bad", [dict(every_steps=0), dict(full_every=0), dict(every_s=0),
                                 dict(every_s=float("inf")), dict(dtype="i8"),
                                 dict(names="mlp.weight"), dict(rank=-1), dict(threaded=1)])
def test_options_are_checked(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        DenseOptions(**bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_model_is_copied_to_host_asynchronously_and_stays_a_snapshot():
    model = Model().cuda()
    copier = DenseCopier()
    copies, ready = copier.copy(dense_entries(model))
    want = model.mlp.weight.detach().cpu().clone()
    _train(model, 0)  # queued after the copy on the training stream
    assert ready is not None
    ready.synchronize()
    assert copies["mlp.weight"].device.type == "cpu" and copies["mlp.weight"].is_pinned()
    torch.testing.assert_close(copies["mlp.weight"], want)
