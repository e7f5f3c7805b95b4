"""ShardedEmbedding with 2 real processes (gloo on CPU) equals one HashTable holding all ids.

Each rank trains on its own batches; the reference is a single-process HashTable that sees
the batches of both ranks in one loss (the sum of the per-rank losses). Forward rows,
the sparse gradients that reach the owners, the rows after SGD / row-wise Adagrad steps,
eval-mode behaviour and ``select_changed`` on the local shard must all agree.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deltastream.embedding.hashtable import HashTable
from deltastream.embedding.optim import RowWiseAdagrad, SparseSGD
from deltastream.publishing.selection import select_changed
from deltastream.sharding import owner_of
from deltastream.tracking.tracker import DeltaTracker
from deltastream.types import DeltaRows, TrackingMode

pytestmark = pytest.mark.integration

WORLD = 2
STEPS = 4
DIMS = {"sgd": 8, "ada": 4}
PRE_IDS = torch.tensor([-70_001, -5, 0, 3, 65_536, 65_537, 100_000, 131_071, 200_003, 999_999])


def id_initializer(n: int, dim: int, *, ids: torch.Tensor, dtype=torch.float32, device="cpu"):
    """Rows derived from the ids: the same on every rank and in the reference table."""
    freq = torch.arange(1, dim + 1, dtype=torch.float64, device=device)
    return torch.sin(ids.to(torch.float64)[:, None] * 0.37 * freq).to(dtype)


def pre_rows(dim: int) -> torch.Tensor:
    return torch.cos(PRE_IDS.to(torch.float64)[:, None] * 0.11 *
                     torch.arange(1, dim + 1, dtype=torch.float64)).float()


def batch(step: int, rank: int) -> torch.Tensor:
    """Ids [B, 3] of one rank at one step: pre-inserted ids, fresh ids, duplicates."""
    if step == 2 and rank == 1:
        return torch.empty(0, 3, dtype=torch.int64)  # an empty batch still joins collectives
    g = torch.Generator().manual_seed(100 * step + rank)
    pool = torch.cat([PRE_IDS, torch.arange(-300_000, 300_000, 9_973)])
    return pool[torch.randint(0, pool.numel(), (5 + 3 * rank, 3), generator=g)]


def loss_of(out: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + 100 * step + rank)
    c = torch.rand(out.shape[-1], generator=g)
    return (out.pow(2) * c).sum() + out.sum(-1).tanh().sum()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, outdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        from deltastream.embedding.sharded import ShardedEmbedding

        embs = {name: ShardedEmbedding(dim, name=name, initializer=id_initializer, capacity=16)
                for name, dim in DIMS.items()}
        model = torch.nn.ModuleDict(embs)
        for name, emb in embs.items():
            mine = owner_of(PRE_IDS, WORLD) == rank  # each rank inserts the rows it owns
            emb.table.insert(PRE_IDS[mine], pre_rows(DIMS[name])[mine])
        opts = [SparseSGD(embs["sgd"], lr=0.1), RowWiseAdagrad(embs["ada"], lr=0.1)]
        first = {n: (e.table.ids(), e.table.embeddings()) for n, e in embs.items()}
        tracker = DeltaTracker(model, mode=TrackingMode.EMBEDDING)
        rec: dict = {"outs": [], "grads": [], "slices": {}}
        for step in range(STEPS):
            ids = batch(step, rank)
            outs = {n: e(ids) for n, e in model.items()}
            loss = sum(loss_of(o, step, rank) for o in outs.values())
            loss.backward()
            rec["outs"].append({n: o.detach() for n, o in outs.items()})
            grads = {}
            for n, e in embs.items():
                sg = e.table.sparse_grad()
                grads[n] = (sg.ids, sg.values) if sg is not None else None
            rec["grads"].append(grads)
            for opt in opts:
                opt.step()
                opt.zero_grad()
        # the tracker sees the owner's lookups: global ids of this rank's slice range
        rec["tracked"] = {f: (d.ids, d.states) for f, d in tracker.get_delta().items()}
        # eval mode: unseen ids are not inserted and read as the eval value (0)
        model.eval()
        sizes = {n: len(e.table) for n, e in embs.items()}
        probe = torch.tensor([[12_345_678, int(PRE_IDS[3])], [-98_765_432, 0]])
        rec["eval"] = embs["sgd"](probe)
        assert {n: len(e.table) for n, e in embs.items()} == sizes
        rec["final"] = {n: (e.table.ids(), e.table.embeddings()) for n, e in embs.items()}
        rec["slices"] = {n: (e.slice.begin, e.slice.end) for n, e in embs.items()}
        # select_changed reads the local shard; FIRST = rows before training
        ids0, rows0 = first["sgd"]
        order = torch.argsort(ids0)
        delta = DeltaRows(ids=ids0[order], states=rows0[order])
        sel = select_changed(delta, embs["sgd"], k=3)
        rec["select"] = (delta.ids, delta.states, sel.ids, sel.rows, sel.scores)
        # a group of one (process_group argument): no exchange, the whole slice space
        singles = [dist.new_group([r]) for r in range(WORLD)]  # collective: all ranks
        solo = ShardedEmbedding(4, name="solo", process_group=singles[rank],
                                initializer=id_initializer)
        rec["solo"] = (solo.world_size, solo.rank, solo.slice.begin, solo.slice.end,
                       solo(batch(0, rank)).detach())
        torch.save(rec, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _reference():
    tables = {n: HashTable(d, name=n, initializer=id_initializer, capacity=16)
              for n, d in DIMS.items()}
    for n, t in tables.items():
        t.insert(PRE_IDS, pre_rows(DIMS[n]))
    opts = [SparseSGD(tables["sgd"], lr=0.1), RowWiseAdagrad(tables["ada"], lr=0.1)]
    rec: dict = {"outs": [], "grads": []}
    for step in range(STEPS):
        outs = [{n: t(batch(step, r)) for n, t in tables.items()} for r in range(WORLD)]
        loss = sum(loss_of(o, step, r) for r in range(WORLD) for o in outs[r].values())
        loss.backward()
        rec["outs"].append([{n: o.detach() for n, o in d.items()} for d in outs])
        rec["grads"].append({n: t.sparse_grad() for n, t in tables.items()})
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return tables, rec


def _pre_by_id(ids: torch.Tensor, dim: int) -> torch.Tensor:
    rows = pre_rows(dim)
    return rows[(ids[:, None] == PRE_IDS[None, :]).int().argmax(1)]


def _by_id(ids: torch.Tensor, values: torch.Tensor):
    order = torch.argsort(ids)
    return ids[order], values[order]


def test_two_processes_match_single_table(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    tables, ref = _reference()

    assert got[0]["slices"]["sgd"] == (0, 32768) and got[1]["slices"]["sgd"] == (32768, 65536)
    for r in range(WORLD):  # every rank needs rows from both owners: real cross-rank traffic
        assert set(owner_of(batch(0, r), WORLD).unique().tolist()) == {0, 1}
    for step in range(STEPS):
        for r in range(WORLD):
            for n in DIMS:
                out = got[r]["outs"][step][n]
                assert out.shape == (*batch(step, r).shape, DIMS[n])
                torch.testing.assert_close(out, ref["outs"][step][r][n], rtol=0, atol=0)
        # the gradient that reached the owners = the single table's gradient
        for n in DIMS:
            ids = torch.cat([got[r]["grads"][step][n][0] for r in range(WORLD)])
            vals = torch.cat([got[r]["grads"][step][n][1] for r in range(WORLD)])
            ids, vals = _by_id(ids, vals)
            rid, rval = _by_id(ref["grads"][step][n].ids, ref["grads"][step][n].values)
            assert torch.equal(ids, rid)
            torch.testing.assert_close(vals, rval, rtol=1e-5, atol=1e-6)
            # each owner received gradients only for ids of its own slice range
            for r in range(WORLD):
                assert bool((owner_of(got[r]["grads"][step][n][0], WORLD) == r).all())

    for n, table in tables.items():
        ids = torch.cat([got[r]["final"][n][0] for r in range(WORLD)])
        rows = torch.cat([got[r]["final"][n][1] for r in range(WORLD)])
        ids, rows = _by_id(ids, rows)
        rid, rrows = _by_id(table.ids(), table.embeddings())
        assert torch.equal(ids, rid), "the shards together hold exactly the reference ids"
        torch.testing.assert_close(rows, rrows, rtol=1e-5, atol=1e-6)
        assert not torch.equal(rows, table.lookup(ids) * 0), "training changed the rows"
        for r in range(WORLD):
            assert bool((owner_of(got[r]["final"][n][0], WORLD) == r).all())

    touched = torch.unique(torch.cat([batch(s, r).reshape(-1) for s in range(STEPS)
                                      for r in range(WORLD)]))
    for r in range(WORLD):
        tracked = got[r]["tracked"]
        assert sorted(tracked) == ["ada.table", "sgd.table"]
        mine = touched[owner_of(touched, WORLD) == r]
        ids, states = tracked["sgd.table"]
        assert torch.equal(ids, mine)
        # FIRST = the value before the first update: initializer or pre-inserted rows
        pre = torch.isin(ids, PRE_IDS)
        want = id_initializer(int(ids.numel()), DIMS["sgd"], ids=ids)
        want[pre] = _pre_by_id(ids[pre], DIMS["sgd"])
        torch.testing.assert_close(states, want)

    tables["sgd"].eval()
    probe = torch.tensor([[12_345_678, int(PRE_IDS[3])], [-98_765_432, 0]])
    for r in range(WORLD):
        torch.testing.assert_close(got[r]["eval"], tables["sgd"](probe), rtol=1e-5, atol=1e-6)
        d_ids, d_states, sel_ids, sel_rows, sel_scores = got[r]["select"]
        delta = DeltaRows(ids=d_ids, states=d_states)
        want = select_changed(delta, tables["sgd"], k=3)
        assert len(delta) > 3 and torch.equal(sel_ids, want.ids)
        torch.testing.assert_close(sel_rows, want.rows, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sel_scores, want.scores, rtol=1e-4, atol=1e-5)
        world, grank, begin, end, out = got[r]["solo"]
        assert (world, grank, begin, end) == (1, 0, 0, 65536)
        solo = HashTable(4, name="solo", initializer=id_initializer)
        torch.testing.assert_close(out, solo(batch(0, r)).detach(), rtol=0, atol=0)


def test_needs_initialized_process_group():
    from deltastream.embedding.sharded import ShardedEmbedding

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        ShardedEmbedding(4, name="x")
