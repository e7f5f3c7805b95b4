"""A DistributedDataParallel model (gloo, 2 processes) with nn.Embedding + nn.EmbeddingBag
trained by Adam: rank 0's tracker publishes through the embedded broker, and the predictor
ends equal to the trainer for every row that ever changed — also rows only rank 1 looked
up (DDP all-reduces their gradients into rank 0's replica) and rows Adam kept moving.
"""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from consumers import ServingTable, TopicReader
from deltastream import DeltaPublisher, DeltaTracker, TrackingMode, ensure_topic, wire
from deltastream.publishing.rounds import SelectionPolicy, publish_delta

pytestmark = pytest.mark.integration

WORLD = 2
ROWS, DIM, STEPS = 200, 8, 16


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(ROWS, DIM)
        self.bag = torch.nn.EmbeddingBag(ROWS, DIM, mode="mean")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids).sum(1) + self.bag(ids)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, servers: str, topic: str, outdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        torch.manual_seed(0)  # the same replica everywhere
        net = Net()
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        opt = torch.optim.Adam(ddp.parameters(), lr=0.05)
        with pytest.raises(ValueError, match="DistributedDataParallel.*other ranks"):
            DeltaTracker(ddp, sparse_updates_only=True)
        tracker = DeltaTracker(ddp, consumers=["pub"], mode=TrackingMode.EMBEDDING)
        assert tracker.paths == {"emb": "scan", "bag": "scan"}
        assert tracker.table("emb") is net.emb  # names resolve whatever the wrapper
        w0 = {n: m.weight.detach().clone() for n, m in (("emb", net.emb), ("bag", net.bag))}
        ever = {n: torch.zeros(ROWS, dtype=torch.bool) for n in w0}
        g = torch.Generator().manual_seed(10 + rank)
        # rank 0 looks up rows [0, 100), rank 1 rows [100, 200): rank 0's hooks never see
        # half of the rows that change in its replica
        lo = 100 * rank
        pub = DeltaPublisher(servers, topic, model="ddp", shard=0, dtype="f32") \
            if rank == 0 else None
        for step in range(STEPS):
            ids = lo + torch.randint(0, min(100, 30 + 5 * step), (4, 3), generator=g)
            ddp(ids).square().sum().backward()
            opt.step()
            opt.zero_grad()
            tracker.step()
            for n, m in (("emb", net.emb), ("bag", net.bag)):
                ever[n] |= (m.weight.detach() != w0[n]).any(1)
            if pub is not None and step % 5 == 4:
                publish_delta(tracker, pub, "pub", SelectionPolicy(fraction=0.5), step=step)
        if pub is not None:
            publish_delta(tracker, pub, "pub", step=STEPS, final=True)
            pub.flush()
            pub.close()
        torch.save({"weights": {"emb": net.emb.weight.detach(), "bag": net.bag.weight.detach()},
                    "ever": ever, "stats": tracker.stats()},
                   os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_ddp_rank0_publishes_every_changed_row(broker, topic_name, tmp_path):
    servers = broker.bootstrap_servers
    ensure_topic(servers, topic_name, 1)
    mp.spawn(_worker, args=(_free_port(), servers, topic_name, str(tmp_path)), nprocs=WORLD,
             join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for n in ("emb", "bag"):  # DDP kept the replicas equal
        assert torch.equal(got[0]["weights"][n], got[1]["weights"][n])
    serving: dict[str, ServingTable] = {}
    with TopicReader(servers, topic_name, timeout=15.0) as reader:
        for rec in reader.read(reader.beginning_offsets(), reader.end_offsets()):
            batch = wire.decode(rec.value)
            serving.setdefault(batch.table, ServingTable(batch.table, DIM)).apply(batch)
    assert sorted(serving) == ["bag", "emb"]
    for n in ("emb", "bag"):
        ever = got[0]["ever"][n] | got[1]["ever"][n]
        ids = ever.nonzero().squeeze(1)
        assert bool((ids >= 100).any()), "rows only rank 1 looked up changed too"
        want = got[0]["weights"][n][ids].numpy()
        np.testing.assert_array_equal(serving[n].lookup(ids.numpy()), want)
        held = np.asarray(serving[n].ids(), dtype=np.int64)
        np.testing.assert_array_equal(serving[n].lookup(held), got[0]["weights"][n][held].numpy())
    assert got[0]["stats"]["rows_moved_without_lookup"] > 0
