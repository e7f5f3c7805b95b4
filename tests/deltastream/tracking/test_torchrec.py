"""DeltaTracker on TorchRec collections: unsharded (trained by a dense torch.optim optimizer)
and sharded by DistributedModelParallel (world size 1, gloo, every sharding type x fused
optimizer that runs on CPU); TorchRecDeltaSource's id mapping and empty intervals.

The 2-process run through a real broker and SyncDaemon is
``tests/integration/test_torchrec_dmp.py``.
"""

from __future__ import annotations

import socket

import pytest
import torch

pytest.importorskip("torchrec", reason="TorchRec is not installed (pip install "
                    "'deltastream[torchrec]', see the Makefile)")

import torch.distributed as dist  # noqa: E402
from torchrec import (  # noqa: E402
    EmbeddingBagConfig,
)

from deltastream import DeltaTracker, TorchRecDeltaSource, TrackingMode  # noqa: E402
from deltastream.tracking.torchrec_interop import to_global  # noqa: E402
from deltastream.tracking.torchrec_tables import TorchRecTable  # noqa: E402
from tests.deltastream.tracking.torchrec_models import Unsharded, unsharded_batch  # noqa: E402


def _weights(tracker: DeltaTracker) -> dict[str, torch.Tensor]:
    return {k: t.weight.detach().clone() for k, t in tracker.get_tracked_modules().items()}


def _check_exact(tracker: DeltaTracker, before: dict[str, torch.Tensor], delta: dict) -> int:
    """Every changed row and only those, with global ids and FIRST = value at the last read."""
    seen = 0
    for key, table in tracker.get_tracked_modules().items():
        changed = (table.weight.detach() != before[key]).any(1).nonzero().squeeze(1)
        d = delta[key]
        assert torch.equal(d.ids, changed + table.row_offset), key
        if d.states is not None:
            assert torch.equal(d.states, before[key][changed]), key
        seen += len(d)
    return seen


def test_unsharded_collections_with_adam_report_every_changed_row():
    torch.manual_seed(0)
    model = Unsharded()
    tracker = DeltaTracker(model, mode=TrackingMode.EMBEDDING, sparse_updates_only=True)
    keys = ["ebc.embedding_bags.user", "ebc.embedding_bags.item", "ec.embeddings.hist"]
    assert tracker.tracked_fqns == keys
    assert tracker.paths == dict.fromkeys(keys, "scan")  # True covers nn.Embedding only
    names = {k: t.name for k, t in tracker.get_tracked_modules().items()}
    assert names == dict(zip(keys, ["user", "item", "hist"], strict=True))
    assert tracker.table(keys[0]).lookup(torch.tensor([3])).shape == (1, 8)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    before = _weights(tracker)
    unlooked = 0
    for step in range(12):
        bag, seq = unsharded_batch(step)
        model(bag, seq).backward()
        opt.step()
        opt.zero_grad()
        tracker.step()
        if step % 4 == 3:
            assert _check_exact(tracker, before, tracker.get_delta()) > 0
            before = _weights(tracker)
    unlooked = tracker.stats()["rows_moved_without_lookup"]
    assert unlooked > 0  # Adam's moments moved rows that were not looked up
    assert all(len(d) == 0 for d in tracker.get_delta().values())  # nothing since


def test_unsharded_lookups_path_is_refused_for_torchrec_tables():
    with pytest.raises(ValueError, match="TorchRec tables are tracked by the scan"):
        DeltaTracker(Unsharded(), sparse_updates_only=["ebc.embedding_bags.user"])


def test_unsupported_torchrec_module_is_named_in_an_error():
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEBC

    quant = QuantEBC([EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=10,
                                         feature_names=["f"])], is_weighted=False,
                     device=torch.device("cpu"))
    model = torch.nn.ModuleDict({"serving": quant, "learn": Unsharded()})
    with pytest.raises(ValueError, match=r"TorchRec module serving .*quantized"):
        DeltaTracker(model)
    tracker = DeltaTracker(model, fqns_to_skip=["serving"])
    assert tracker.tracked_fqns[0] == "learn.ebc.embedding_bags.user"
    # one table of a collection can be skipped by its name
    assert "learn.ebc.embedding_bags.item" not in DeltaTracker(
        model, fqns_to_skip=["serving", "item"]).tracked_fqns


def _view(name: str, rows: int, row_offset: int, col: int = 0, full=None, sid=None):
    w = torch.zeros(rows, 2)
    return TorchRecTable(name, "row_wise", 100, rows, 2, row_offset, col, full, sid,
                         lambda: w)


def test_to_global_adds_the_local_shards_row_offset():
    views = {"ebc.embedding_bags.rw": _view("rw", 50, 50, full=2, sid=1),
             "ebc.embedding_bags.cw#0": _view("cw", 100, 0, 0, 4, 0),
             "ebc.embedding_bags.cw#2": _view("cw", 100, 0, 2, 4, 2)}
    out = to_global(views, "ebc.embedding_bags.rw", torch.tensor([7, 3, 7, 0]))
    assert list(out) == ["ebc.embedding_bags.rw"]
    assert out["ebc.embedding_bags.rw"].tolist() == [50, 53, 57]
    out = to_global(views, "ebc.embedding_bags.cw", torch.tensor([9, 1]))
    assert {k: v.tolist() for k, v in out.items()} == {
        "ebc.embedding_bags.cw#0": [1, 9], "ebc.embedding_bags.cw#2": [1, 9]}
    # an id past the local shard cannot be this rank's row: dropped (and logged)
    assert to_global(views, "ebc.embedding_bags.rw", torch.tensor([2, 50]))[
        "ebc.embedding_bags.rw"].tolist() == [52]


@pytest.fixture
def gloo_world_1():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_dmp_every_sharding_and_fused_optimizer_exact(gloo_world_1):
    from torchrec.distributed.model_tracker.types import DeltaTrackerConfig

    from tests.deltastream.tracking.torchrec_models import (
        bag_tables,
        batches,
        build_dmp,
        seq_tables,
    )

    dmp = build_dmp(bag_tables(), seq_tables(), 1)
    dmp.init_torchrec_delta_tracker(DeltaTrackerConfig(consumers=["trec"]))
    tracker = DeltaTracker(dmp, mode=TrackingMode.EMBEDDING, consumers=["a", "b"])
    ids_only = DeltaTracker(dmp)
    tables = tracker.get_tracked_modules()
    shardings = {t.sharding for t in tables.values()}
    assert shardings == {"table_wise", "column_wise", "table_column_wise", "row_wise"}
    assert {t.name for t in tables.values()} == set(bag_tables()) | set(seq_tables())
    split = [t for t in tables.values() if t.full_width is not None]
    assert split and all(t.full_width == 8 and t.shard_id is not None for t in split)
    # every shard sits in a fused kernel: found from the kernels' lookups, no shadow
    assert set(tracker.paths.values()) == {"lookups"} and tracker.stats()["shadow_bytes"] == 0
    before = {c: _weights(tracker) for c in ("a", "b")}
    before_ids = _weights(ids_only)
    for step in range(9):
        dmp(*batches(dmp.module, step, 0)).backward()
        tracker.step()
        if step % 3 == 2:  # consumer a reads every 3 steps, b every 9
            assert _check_exact(tracker, before["a"], tracker.get_delta("a")) > 0
            before["a"] = _weights(tracker)
    assert _check_exact(tracker, before["b"], tracker.get_delta("b")) > 0
    delta = ids_only.get_delta()
    assert all(d.states is None for d in delta.values())
    _check_exact(ids_only, before_ids, delta)
    # load_state_dict writes rows without a lookup: those tables move to the exact scan,
    # which then also sees a manual write
    dmp.load_state_dict(dmp.state_dict())
    assert set(tracker.paths.values()) == {"scan"}
    key = "ebc.embedding_bags.bag_row_wise_sgd"
    with torch.no_grad():
        tables[key].weight[5] += 1.0
    for c in ("a", "b"):
        d = tracker.get_delta(c)
        assert d[key].ids.tolist() == [5] and sum(len(r) for r in d.values()) == 1
    ids_only.close()
    # an interval without training: empty rows, every table a key, no exception —
    # also through TorchRec's own tracker after its delete-on-read
    source = TorchRecDeltaSource(dmp)
    assert sum(len(d) for d in source.get_delta().values()) > 0
    for read in (tracker.get_delta("a"), source.get_delta()):
        assert sorted(read) == sorted(tables) and all(len(d) == 0 for d in read.values())


def test_dmp_first_rows_copied_off_the_training_thread_before_the_fused_update(
        gloo_world_1, monkeypatch):
    """With a core to spare the FIRST rows are copied on the C code's lane thread while the
    kernels run; a hook after each kernel's forward waits for them, before the fused
    update. A held lane (the copy still queued when the forward ends) proves the wait:
    without it the update would be read as the FIRST state."""
    import threading

    from deltastream import cores
    from deltastream.tracking import fresh_rows
    from tests.deltastream.tracking.torchrec_models import (
        bag_tables,
        batches,
        build_dmp,
        seq_tables,
    )

    if not fresh_rows.NATIVE_AVAILABLE:
        pytest.skip("deltastream.tracking.native is not built")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # one core to spare here
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: {0, 1})
    assert fresh_rows.spare_core()
    dmp = build_dmp(bag_tables(), seq_tables(), 1)
    tracker = DeltaTracker(dmp, mode=TrackingMode.EMBEDDING)
    before = _weights(tracker)
    native = fresh_rows.native
    try:
        for step in range(6):
            if step % 3 == 1:  # the copies queued, not run, when the backward starts
                native.hold_lane(True)
                threading.Timer(0.3, native.hold_lane, (False,)).start()
            dmp(*batches(dmp.module, step, 0)).backward()
            tracker.step()
            if step % 3 == 2:
                assert _check_exact(tracker, before, tracker.get_delta()) > 0
                before = _weights(tracker)
    finally:
        native.hold_lane(False)
        tracker.close()


def test_torchrec_tracker_bench_runs_small():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from bench.torchrec_tracker import main

    records = main(["--rows", "2000", "--batch", "64", "--rounds", "1", "--read-every", "2"])
    assert [r["name"] for r in records] == [
        "torchrec_tracker.deltastream_embedding", "torchrec_tracker.deltastream_id_only",
        "torchrec_tracker.torchrec_embedding", "torchrec_tracker.torchrec_id_only"]
    assert all(r["value"] > 0 and r["baseline"] > 0 and r["rows_per_read"] > 0
               for r in records)
    assert "vs_torchrec" in records[0]
    assert not dist.is_initialized()  # the bench's own process group is gone
