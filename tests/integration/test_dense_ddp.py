"""DistributedDataParallel (gloo, 2 processes), every rank ticking a DensePublisher with
rank=0: only rank 0 publishes dense versions (one stream, shard 0), and the last version
(full) equals both replicas (DDP keeps them equal)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from consumers import TopicReader
from deltastream import DeltaPublisher, ensure_topic
from deltastream.dense_wire import decode_dense, is_dense
from deltastream.publishing.dense import DenseOptions, DensePublisher
from tests.integration.ports import free_port

pytestmark = pytest.mark.integration

WORLD, STEPS = 2, 6


def _worker(rank: int, port: int, servers: str, topic: str, outdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        # every rank builds its publisher (the shard of its rank); only rank 0's is used
        with DeltaPublisher(servers, topic, model="ddp", shard=rank, dtype="f32") as pub, \
                DensePublisher(pub, ddp, DenseOptions(every_steps=2, rank=0)) as dense:
            g = torch.Generator().manual_seed(rank)
            for step in range(1, STEPS + 1):
                ddp(torch.randn(8, 6, generator=g)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                dense.tick(step)
            dense.flush(STEPS)
            stats = dense.stats()
        torch.save({"state": {k: v.detach().clone() for k, v in net.state_dict().items()},
                    "stats": stats}, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_only_rank_0_publishes_dense_versions(broker, topic_name, tmp_path):
    servers = broker.bootstrap_servers
    ensure_topic(servers, topic_name, 2)
    mp.spawn(_worker, args=(free_port(), servers, topic_name, str(tmp_path)), nprocs=WORLD,
             join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    assert got[0]["stats"]["active"] and not got[1]["stats"]["active"]
    assert got[1]["stats"]["versions"] == 0 and got[0]["stats"]["versions"] >= 2
    with TopicReader(servers, topic_name, timeout=15.0) as reader:
        records = list(reader.read(reader.beginning_offsets(), reader.end_offsets()))
    chunks = [decode_dense(r.value) for r in records if is_dense(r.headers)]
    assert len(chunks) == len(records) and {c.shard for c in chunks} == {0}
    # the final version is flush's full one; a tick's partial version of the same step
    # comes before it when the cadence (shifted by a deferred tick) lands on STEPS
    chunks.sort(key=lambda c: c.seq)
    last = chunks[-chunks[-1].chunks:]
    assert all(c.full and c.step == STEPS for c in last)
    for c in last:
        want = got[0]["state"][c.name].reshape(-1)[c.offset:c.offset + len(c.values)]
        np.testing.assert_array_equal(c.values_f32(), want.numpy())
        torch.testing.assert_close(got[0]["state"][c.name], got[1]["state"][c.name])
