"""ShardedEmbeddingCollection with 2 real processes (gloo) equals whole single-process tables,
and its shards publish through the embedded broker so that a predictor rebuilds full rows.

One spawn runs three plans in turn: table-wise, column-wise, and table-wise-column-wise
(table ``a``'s column shards on ranks ``[0, 1, 0]``: two shards of one table on rank 0, out
of rank order — the TorchRec seed's case — next to a whole table and a row-wise table).
For each plan: forward outputs, the gradients each shard receives and the rows after SGD /
Adam steps equal those of whole HashTables trained on both ranks' batches; then each rank
runs a final ``publish_delta`` to its own topic and the test applies the topic with an
``Applier``: the predictor's tables equal the reference's full rows for every id.
"""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deltastream.embedding.hashtable import HashTable
from deltastream.embedding.optim import SparseAdam, SparseSGD
from deltastream.embedding.plan import ShardingPlan, column_wise, row_wise, table_wise

pytestmark = pytest.mark.integration

WORLD = 2
STEPS = 3
DIMS = {"a": 6, "b": 4, "c": 3}
PLANS = {
    "table": [table_wise("a", 6, 1), table_wise("b", 4, 0), table_wise("c", 3, 1)],
    "column": [column_wise("a", 6, [0, 1]), column_wise("b", 4, [1, 0]),
               column_wise("c", 3, [1, 0], widths=[1, 2])],
    "twcw": [column_wise("a", 6, [0, 1, 0], widths=[2, 1, 3]), table_wise("b", 4, 1),
             row_wise("c", 3, WORLD)],
}


def plan_of(kind: str) -> ShardingPlan:
    return ShardingPlan.of(WORLD, PLANS[kind])


def id_initializer(n: int, dim: int, *, ids: torch.Tensor, dtype=torch.float32, device="cpu"):
    """Rows derived from the ids: the same on every rank and in the reference table."""
    freq = torch.arange(1, dim + 1, dtype=torch.float64, device=device)
    return torch.sin(ids.to(torch.float64)[:, None] * 0.37 * freq).to(dtype)


def batch(step: int, rank: int, table: str) -> torch.Tensor:
    """Ids [B, 2] of one rank, one table, one step (rank 1's table b is empty at step 1)."""
    if step == 1 and rank == 1 and table == "b":
        return torch.empty(0, 2, dtype=torch.int64)
    g = torch.Generator().manual_seed(100 * step + 10 * rank + len(table) + ord(table))
    pool = torch.arange(-40, 200_000, 7_919)
    return pool[torch.randint(0, pool.numel(), (4 + 2 * rank, 2), generator=g)]


def loss_of(out: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + 100 * step + rank + out.shape[-1])
    c = torch.rand(out.shape[-1], generator=g)
    return (out.pow(2) * c).sum() + out.sum(-1).tanh().sum()


def _optimizers(model: torch.nn.Module):
    """SGD for tables a and c, Adam for b (element-wise: column shards update exactly)."""
    tabs = [m for m in model.modules() if isinstance(m, HashTable)]

    def of(name):
        return [t for t in tabs if (getattr(t, "plan_table", None) or t.name) == name]

    sgd, adam = of("a") + of("c"), of("b")  # a rank may hold no shard of a table
    return ([SparseSGD(sgd, lr=0.1)] if sgd else []) + ([SparseAdam(adam, lr=0.05)] if adam
                                                         else [])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, outdir: str, servers: str, topics: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        from deltastream import DeltaPublisher, DeltaTracker, TrackingMode, publish_delta
        from deltastream.embedding.collection import ShardedEmbeddingCollection

        for kind in PLANS:
            coll = ShardedEmbeddingCollection(plan_of(kind), initializer=id_initializer,
                                              capacity=8)
            tracker = DeltaTracker(coll, consumers=["pub"], mode=TrackingMode.EMBEDDING)
            opts = _optimizers(coll)
            rec: dict = {"outs": [], "grads": []}
            for step in range(STEPS):
                outs = coll({n: batch(step, rank, n) for n in DIMS})
                loss = sum(loss_of(o, step, rank) for o in outs.values())
                loss.backward()
                rec["outs"].append({n: o.detach() for n, o in outs.items()})
                grads = {}
                for m in coll.modules():
                    if isinstance(m, HashTable):
                        sg = m.sparse_grad()
                        grads[m.name] = (getattr(m, "column_offset", 0),
                                         None if sg is None else (sg.ids, sg.values))
                rec["grads"].append(grads)
                for opt in opts:
                    opt.step()
                    opt.zero_grad()
            rec["final"] = {m.name: (getattr(m, "plan_table", None) or m.name,
                                     getattr(m, "column_offset", 0), m.ids(), m.embeddings())
                            for m in coll.modules() if isinstance(m, HashTable)}
            with DeltaPublisher(servers, topics[kind], model="m", shard=rank,
                                dtype="f32") as pub:
                publish_delta(tracker, pub, "pub", step=STEPS, final=True)
                pub.flush()
            torch.save(rec, os.path.join(outdir, f"{kind}-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _reference():
    tables = {n: HashTable(d, name=n, initializer=id_initializer, capacity=8)
              for n, d in DIMS.items()}
    opts = _optimizers(torch.nn.ModuleDict(tables))
    rec: dict = {"outs": [], "grads": []}
    for step in range(STEPS):
        outs = [{n: t(batch(step, r, n)) for n, t in tables.items()} for r in range(WORLD)]
        loss = sum(loss_of(o, step, r) for r in range(WORLD) for o in outs[r].values())
        loss.backward()
        rec["outs"].append(outs)
        rec["grads"].append({n: t.sparse_grad() for n, t in tables.items()})
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return tables, rec


def _by_id(ids, values):
    order = torch.argsort(ids)
    return ids[order], values[order]


def _check_plan(kind: str, got: list, tables: dict, ref: dict) -> None:
    plan = plan_of(kind)
    for step in range(STEPS):
        for r in range(WORLD):
            for n, dim in DIMS.items():
                out = got[r]["outs"][step][n]
                assert out.shape == (*batch(step, r, n).shape, dim), (kind, n)
                torch.testing.assert_close(out, ref["outs"][step][r][n].detach(), rtol=0, atol=0)
        # every shard received the reference gradient of its ids, restricted to its columns
        for n, tp in plan.tables.items():
            rid, rval = _by_id(ref["grads"][step][n].ids, ref["grads"][step][n].values)
            if tp.kind == "row":
                parts = [got[r]["grads"][step][n][1] for r in range(WORLD)]
                ids, vals = _by_id(torch.cat([p[0] for p in parts]),
                                   torch.cat([p[1] for p in parts]))
                assert torch.equal(ids, rid)
                torch.testing.assert_close(vals, rval, rtol=1e-5, atol=1e-6)
                continue
            for j, spec in enumerate(tp.shards):
                off, g = got[spec.rank]["grads"][step][f"{n}#{j}"]
                assert off == spec.cols[0]
                ids, vals = _by_id(*g)
                assert torch.equal(ids, rid), (kind, n, j)
                torch.testing.assert_close(vals, rval[:, spec.cols[0]:spec.cols[1]],
                                           rtol=1e-5, atol=1e-6)
    # rows after the optimizer steps: the shards' columns together are the whole rows
    for n, tp in plan.tables.items():
        rid, rrows = _by_id(tables[n].ids(), tables[n].embeddings())
        if tp.kind == "row":
            parts = [got[r]["final"][n] for r in range(WORLD)]
            ids, rows = _by_id(torch.cat([p[2] for p in parts]), torch.cat([p[3] for p in parts]))
            assert torch.equal(ids, rid)
            torch.testing.assert_close(rows, rrows, rtol=1e-5, atol=1e-6)
            continue
        for j, spec in enumerate(tp.shards):
            table, off, ids, rows = got[spec.rank]["final"][f"{n}#{j}"]
            assert (table, off) == (n, spec.cols[0])
            ids, rows = _by_id(ids, rows)
            assert torch.equal(ids, rid)
            torch.testing.assert_close(rows, rrows[:, spec.cols[0]:spec.cols[1]],
                                       rtol=1e-5, atol=1e-6)


def _predictor_tables(servers: str, topic: str) -> dict:
    from consumers import Applier, SeqTracker, TopicReader

    tables: dict = {}
    ap = Applier("m", tables, SeqTracker())
    with TopicReader(servers, topic, timeout=15.0) as reader:
        for rec in reader.read(reader.beginning_offsets(), reader.end_offsets()):
            out = ap.process(rec.value, rec.headers)
            assert out.kind == "applied", out
    return tables


def test_plans_match_whole_tables_and_predictor_gets_full_rows(tmp_path, broker, topic_name):
    from deltastream import ensure_topic

    servers = broker.bootstrap_servers
    topics = {kind: f"{topic_name}-{kind}" for kind in PLANS}
    for t in topics.values():
        ensure_topic(servers, t, WORLD)
    mp.spawn(_worker, args=(_free_port(), str(tmp_path), servers, topics), nprocs=WORLD,
             join=True)
    tables, ref = _reference()
    for kind in PLANS:
        got = [torch.load(tmp_path / f"{kind}-rank{r}.pt") for r in range(WORLD)]
        _check_plan(kind, got, tables, ref)
        served = _predictor_tables(servers, topics[kind])
        assert sorted(served) == sorted(DIMS)
        for n, t in tables.items():
            ids, rows = _by_id(t.ids(), t.embeddings())
            assert len(served[n]) == len(ids), (kind, n)
            np.testing.assert_array_equal(served[n].lookup(ids.numpy()), rows.numpy())
    _check_replay(servers, topics["twcw"], tables)
    # the seed's case: two shards of table a on rank 0 (shards 0 and 2), shard 1 on rank 1
    got0 = torch.load(tmp_path / "twcw-rank0.pt")["final"]
    assert {k for k in got0 if k.startswith("a#")} == {"a#0", "a#2"}


def _check_replay(servers: str, topic: str, tables: dict) -> None:
    """deltastream-replay over the twcw topic: rebuild gives the full rows, dump shows each
    column slice's col/width, stats a stream per column shard with its columns."""
    from consumers.replay.inspect import dump, stats
    from consumers.replay.rebuild import rebuild

    res = rebuild(servers, topic, model="m")
    for n, t in tables.items():
        ids, rows = _by_id(t.ids(), t.embeddings())
        np.testing.assert_array_equal(res.tables[n].lookup(ids.numpy()), rows.numpy())
    cols = {(d["table"], d["shard"], d["col"], d["dim"], d["width"])
            for d in dump(servers, topic, model="m")}
    assert {c for c in cols if c[0] == "a"} == {("a", 0, 0, 2, 6), ("a", 1, 2, 1, 6),
                                                ("a", 2, 3, 3, 6)}
    st = stats(servers, topic, model="m")
    a_cols = {s.shard: s.columns for s in st.streams if s.table == "a"}
    assert a_cols == {0: [[0, 2, 6]], 1: [[2, 3, 6]], 2: [[3, 6, 6]]}
    assert "cols" in st.format_table() and "3-6/6" in st.format_table()
