"""TorchRec models sharded by DistributedModelParallel (2 processes, gloo) end to end.

One spawn trains an EmbeddingBagCollection whose tables cover every sharding type
(table-wise, column-wise, table-wise-column-wise and row-wise, the last forced: the CPU
planner does not offer it) x every fused optimizer fbgemm runs on CPU (EXACT_SGD,
EXACT_ROWWISE_ADAGRAD, EXACT_ADAGRAD) next to an EmbeddingCollection (table-, column-,
row-wise), for a few hundred steps. Each rank:

* tracks the model with ``DeltaTracker`` (EMBEDDING) and publishes through a threaded
  ``BudgetPublisher`` (wire f16) to topic A, with a final flush;
* also runs TorchRec's own tracker (ID_ONLY, through DMP) and publishes it through
  ``TorchRecDeltaSource`` + ``publish_delta`` (wire f32) to topic B; at every such round
  the ids TorchRec reported (mapped to global ids) equal the ids ``DeltaTracker`` reported
  for the same interval, table by table.

Then a ``SyncDaemon`` per topic serves, for every table under its TorchRec name, exactly the
rows that changed, equal to the trainer's full tables gathered from the shards (f16: within
its rounding; f32: exactly).
"""

from __future__ import annotations

import faulthandler
import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("torchrec", reason="TorchRec is not installed (pip install "
                    "'deltastream[torchrec]', see the Makefile)")

pytestmark = pytest.mark.integration

WORLD = 2
STEPS = 240
ROUND = 40  # steps between TorchRec-source rounds (and id comparisons)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, servers: str, topics: tuple[str, str], outdir: str) -> None:
    # a rank that dies in C++ (an abort seen now and then in CI, cause not yet known) prints
    # every thread's Python stack on stderr, which pytest shows with the failure
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        from torchrec.distributed.model_tracker.types import DeltaTrackerConfig
        from torchrec.distributed.model_tracker.types import TrackingMode as TrecMode

        from deltastream import (
            BudgetPolicy,
            BudgetPublisher,
            DeltaPublisher,
            DeltaTracker,
            TorchRecDeltaSource,
            TrackingMode,
            publish_delta,
        )
        from tests.deltastream.tracking.torchrec_models import (
            bag_tables,
            batches,
            build_dmp,
            full_tables,
            seq_tables,
        )

        dmp = build_dmp(bag_tables(), seq_tables(), WORLD)
        dmp.init_torchrec_delta_tracker(DeltaTrackerConfig(
            tracking_mode=TrecMode.ID_ONLY, consumers=["trec"], delete_on_read=True))
        tracker = DeltaTracker(dmp, consumers=["pub", "cmp"], mode=TrackingMode.EMBEDDING)
        source = TorchRecDeltaSource(dmp)
        layout = {k: (t.sharding, t.row_offset, t.column_offset, t.shard_id)
                  for k, t in tracker.get_tracked_modules().items()}
        start = full_tables(dmp)
        pub_a = DeltaPublisher(servers, topics[0], model="trec", shard=rank, dtype="f16")
        pub_b = DeltaPublisher(servers, topics[1], model="trec", shard=rank, dtype="f32")
        budget = BudgetPublisher(tracker, pub_a, "pub", BudgetPolicy(bytes_per_step=3_000))
        compared = mismatched = 0
        net = dmp.module
        for step in range(STEPS):
            loss = dmp(*batches(net, step, rank))
            loss.backward()
            tracker.step()
            budget.tick(step)
            if step % ROUND == ROUND - 1:
                ours = {k: d.ids for k, d in tracker.get_delta("cmp").items()}
                rnd = publish_delta(source, pub_b, "trec", step=step)
                theirs = {t.fqn: t.ids for t in rnd.tables}
                for key, ids in ours.items():
                    other = theirs.get(key, torch.empty(0, dtype=torch.int64))
                    compared += 1
                    if not torch.equal(ids, other):
                        mismatched += 1
                        print(f"rank {rank} step {step} {key}: ours {ids.tolist()} "
                              f"torchrec {other.tolist()}", flush=True)
        budget.flush(STEPS)
        budget.close()
        publish_delta(source, pub_b, "trec", step=STEPS, final=True)
        for p in (pub_a, pub_b):
            p.flush()
            p.close()
        end = full_tables(dmp)
        if rank == 0:
            torch.save({"start": start, "end": end, "compared": compared,
                        "mismatched": mismatched, "stats": tracker.stats()},
                       os.path.join(outdir, "result.pt"))
        else:
            torch.save({"compared": compared, "mismatched": mismatched, "layout": layout},
                       os.path.join(outdir, "rank1.pt"))
        tracker.close()
        dist.barrier()  # neither rank tears its gloo pairs down while the other still talks
    finally:
        dist.destroy_process_group()


def _served(servers: str, topic: str, state_dir) -> dict:
    from consumers.sync import SyncDaemon

    daemon = SyncDaemon(servers, topic, model="trec", state_dir=state_dir, summary_interval=0)
    try:
        assert daemon.catch_up(timeout=60)
        return {name: (np.asarray(t.ids(), dtype=np.int64), t)
                for name, t in daemon.tables().items()}
    finally:
        daemon.stop()


@pytest.mark.slow
def test_dmp_sharded_collections_tracked_published_served(broker, topic_name, tmp_path):
    from deltastream import ensure_topic

    servers = broker.bootstrap_servers
    topics = (topic_name + "-a", topic_name + "-b")
    for t in topics:
        ensure_topic(servers, t, 2)
    mp.spawn(_worker, args=(_free_port(), servers, topics, str(tmp_path)), nprocs=WORLD,
             join=True)
    res = torch.load(tmp_path / "result.pt")
    other = torch.load(tmp_path / "rank1.pt")
    assert res["compared"] > 0 and other["compared"] > 0
    assert res["mismatched"] == 0 and other["mismatched"] == 0
    layout = other["layout"]  # rank 1: a row-wise shard's rows start past rank 0's
    assert layout["ebc.embedding_bags.bag_row_wise_sgd"] == ("row_wise", 32, 0, 1)
    assert layout["ec.embeddings.seq_row_wise"] == ("row_wise", 32, 0, 1)
    cw = [v for k, v in layout.items() if "bag_column_wise_sgd" in k]
    assert cw and all(v[0] == "column_wise" and v[3] is not None for v in cw)
    assert any(v[2] > 0 for v in cw)
    start, end = res["start"], res["end"]
    for topic, tol in ((topics[0], 2e-3), (topics[1], 0.0)):
        served = _served(servers, topic, tmp_path / f"state-{topic[-1]}")
        assert sorted(served) == sorted(end), topic
        for name, full in end.items():
            changed = (full != start[name]).any(1).nonzero().squeeze(1).numpy()
            ids, table = served[name]
            assert changed.size > 0 and changed.size < full.shape[0], name  # cold rows stay
            np.testing.assert_array_equal(np.sort(ids), changed, err_msg=f"{topic} {name}")
            got = table.lookup(changed)
            want = full[torch.from_numpy(changed)].numpy()
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol,
                                       err_msg=f"{topic} {name}")


def test_unsharded_collections_trained_by_adam_served(broker, topic_name, tmp_path):
    """An unsharded EmbeddingBagCollection + EmbeddingCollection trained by torch.optim.Adam
    (moments move rows long after their last lookup), published by a BudgetPublisher: the
    daemon serves exactly the rows that changed, under the TorchRec table names, equal to the
    trainer's within f16."""
    from deltastream import (
        BudgetPolicy,
        BudgetPublisher,
        DeltaPublisher,
        DeltaTracker,
        TrackingMode,
        ensure_topic,
    )
    from tests.deltastream.tracking.torchrec_models import Unsharded, unsharded_batch

    servers = broker.bootstrap_servers
    ensure_topic(servers, topic_name, 1)
    torch.manual_seed(1)
    model = Unsharded()
    start = {n: m.weight.detach().clone() for n, m in (
        ("user", model.ebc.embedding_bags["user"]), ("item", model.ebc.embedding_bags["item"]),
        ("hist", model.ec.embeddings["hist"]))}
    tracker = DeltaTracker(model, consumers=["pub"], mode=TrackingMode.EMBEDDING)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with DeltaPublisher(servers, topic_name, model="trec", shard=0, dtype="f16") as pub:
        budget = BudgetPublisher(tracker, pub, "pub", BudgetPolicy(bytes_per_step=400))
        for step in range(200):
            model(*unsharded_batch(step)).backward()
            opt.step()
            opt.zero_grad()
            tracker.step()
            budget.tick(step)
        budget.flush(200)
        budget.close()
        pub.flush()
    end = {"user": model.ebc.embedding_bags["user"].weight, "item":
           model.ebc.embedding_bags["item"].weight, "hist": model.ec.embeddings["hist"].weight}
    served = _served(servers, topic_name, tmp_path / "state")
    assert sorted(served) == ["hist", "item", "user"]
    assert tracker.stats()["rows_moved_without_lookup"] > 0
    for name, w in end.items():
        changed = (w.detach() != start[name]).any(1).nonzero().squeeze(1).numpy()
        ids, table = served[name]
        np.testing.assert_array_equal(np.sort(ids), changed, err_msg=name)
        np.testing.assert_allclose(table.lookup(changed), w.detach()[changed].numpy(),
                                   rtol=2e-3, atol=2e-3, err_msg=name)
