"""TorchRec models for the tracker tests: an EmbeddingBagCollection and an
EmbeddingCollection whose tables cover every sharding type x fused optimizer that runs on
CPU, a per-table sharding plan, and deterministic KeyedJaggedTensor batches.

Importing this module needs TorchRec; tests import it after ``pytest.importorskip``.

On CPU, fbgemm's fused kernels run EXACT_SGD, EXACT_ADAGRAD and EXACT_ROWWISE_ADAGRAD (Adam and
PARTIAL_ROWWISE_ADAM are CUDA-only); the CPU planner offers data-parallel, table-wise,
column-wise and table-wise-column-wise, so row-wise is forced with ``row_wise()``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torchrec.optim as trec_optim
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

ROWS, DIM, SEQ_DIM = 64, 8, 4

#: fused optimizer per short name (in-backward optimizer class, kwargs)
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.05}),
    "rwada": (trec_optim.RowWiseAdagrad, {"lr": 0.05}),
    "ada": (torch.optim.Adagrad, {"lr": 0.05}),
}
BAG_SHARDINGS = ("table_wise", "column_wise", "table_column_wise", "row_wise")
SEQ_SHARDINGS = ("table_wise", "column_wise", "row_wise")


def bag_tables(shardings=BAG_SHARDINGS, optimizers=tuple(OPTIMIZERS)) -> list[str]:
    return [f"bag_{s}_{o}" for s in shardings for o in optimizers]


def seq_tables(shardings=SEQ_SHARDINGS) -> list[str]:
    return [f"seq_{s}" for s in shardings]


def sharding_of(table: str) -> str:
    return next(s for s in BAG_SHARDINGS if table.split("_", 1)[1].startswith(s))


def optimizer_of(table: str) -> str:
    return table.rsplit("_", 1)[1] if table.startswith("bag_") else "sgd"


class Net(torch.nn.Module):
    """``ebc`` (pooled features ``f_<table>``), ``ec`` (sequence features) and a dense
    layer (DMP wraps the dense part in DistributedDataParallel, as in a real model)."""

    def __init__(self, bags: list[str], seqs: list[str], device: str = "meta") -> None:
        super().__init__()
        dev = torch.device(device)
        self.ebc = EmbeddingBagCollection(device=dev, tables=[
            EmbeddingBagConfig(name=t, embedding_dim=DIM, num_embeddings=ROWS,
                               feature_names=[f"f_{t}"]) for t in bags])
        self.ec = EmbeddingCollection(device=dev, tables=[
            EmbeddingConfig(name=t, embedding_dim=SEQ_DIM, num_embeddings=ROWS,
                            feature_names=[f"f_{t}"]) for t in seqs]) if seqs else None
        self.dense = torch.nn.Linear(DIM, 1, device=dev)  # DMP wraps dense parts in DDP
        self.bags, self.seqs = bags, seqs

    def forward(self, bag: KeyedJaggedTensor, seq: KeyedJaggedTensor | None) -> torch.Tensor:
        out = self.ebc(bag).values()
        loss = (out * torch.linspace(0.5, 1.5, out.shape[1])).square().sum()
        loss = loss + self.dense(out.reshape(-1, DIM)).sum()
        if self.ec is not None and seq is not None:
            for jt in self.ec(seq).values():
                loss = loss + jt.values().square().sum() * 0.5 + jt.values().sum()
        return loss


def kjt(features: list[str], step: int, rank: int, per_feature: int = 3,
        rows: int = ROWS) -> KeyedJaggedTensor:
    """A batch of 2 samples per feature, ids skewed towards low rows; the top quarter of
    the rows is never looked up (it stays cold)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    vals = (torch.rand(len(features) * per_feature, generator=g).pow(2)
            * (rows * 3 // 4)).long()
    lengths = torch.tensor([1, per_feature - 1] * len(features))
    return KeyedJaggedTensor.from_lengths_sync(keys=features, values=vals, lengths=lengths)


def batches(net: Net, step: int, rank: int):
    bag = kjt([f"f_{t}" for t in net.bags], step, rank)
    seq = kjt([f"f_{t}" for t in net.seqs], step + 7919, rank) if net.seqs else None
    return bag, seq


def _plan_for(module: torch.nn.Module, sharder, names: list[str], world: int, kind: str):
    forced_rw = [t for t in names if sharding_of(t) == "row_wise"]
    cons = {t: ParameterConstraints(
        sharding_types=["table_wise" if t in forced_rw else sharding_of(t)],
        compute_kernels=["fused"], min_partition=2) for t in names}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu"), constraints=cons)
    plan = planner.collective_plan(module, [sharder], dist.GroupMember.WORLD)
    if forced_rw:
        rw = construct_module_sharding_plan(
            module, {t: row_wise(compute_kernel="fused") if t in forced_rw
                     else table_wise(rank=0, compute_kernel="fused") for t in names},
            sharder=sharder, world_size=world, local_size=world, device_type="cpu")
        plan.plan[kind].update({t: rw[t] for t in forced_rw})
    return plan.plan[kind]


def build_dmp(bags: list[str], seqs: list[str], world: int, seed: int = 0,
              **dmp_kwargs) -> DistributedModelParallel:
    """``Net`` sharded by DMP on CPU (gloo must be initialized): every table by its
    sharding and fused optimizer (through ``apply_optimizer_in_backward``)."""
    from torchrec.distributed.types import ShardingPlan

    torch.manual_seed(seed)
    net = Net(bags, seqs)
    for t in bags:
        cls, kw = OPTIMIZERS[optimizer_of(t)]
        # a copy: TorchRec adds to the kwargs it is given (a second model would fail)
        apply_optimizer_in_backward(cls, [net.ebc.embedding_bags[t].weight], dict(kw))
    for t in seqs:
        apply_optimizer_in_backward(torch.optim.SGD, [net.ec.embeddings[t].weight],
                                    {"lr": 0.05})
    ebc_sharder, ec_sharder = EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()
    plans = {"ebc": _plan_for(net.ebc, ebc_sharder, bags, world, "")}
    if seqs:
        plans["ec"] = _plan_for(net.ec, ec_sharder, seqs, world, "")
    return DistributedModelParallel(net, device=torch.device("cpu"),
                                    plan=ShardingPlan(plans),
                                    sharders=[ebc_sharder, ec_sharder], **dmp_kwargs)


def full_tables(dmp: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every table's full weight ``{table name: [ROWS, dim]}`` gathered from the shards
    (collective: every rank calls it; every rank gets the full tables)."""
    out = {}
    for key, value in dmp.state_dict().items():
        if not key.endswith(".weight") or ("embedding_bags." not in key
                                           and "embeddings." not in key):
            continue
        name = key.split(".")[-2]
        if isinstance(value, torch.Tensor) and type(value) in (torch.Tensor,
                                                               torch.nn.Parameter):
            out[name] = value.detach().clone()
            continue
        size = tuple(value.metadata().size)
        full = torch.zeros(size)
        for s in value.local_shards():
            r, c = s.metadata.shard_offsets
            h, w = s.metadata.shard_sizes
            full[r:r + h, c:c + w] = s.tensor.detach()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(full)  # shards are disjoint: the sum assembles them
        out[name] = full
    return out


class Unsharded(torch.nn.Module):
    """Unsharded collections: ``ebc`` (tables user, item) and ``ec`` (table hist)."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name="user", embedding_dim=8, num_embeddings=50,
                               feature_names=["u"]),
            EmbeddingBagConfig(name="item", embedding_dim=4, num_embeddings=30,
                               feature_names=["i"])])
        self.ec = EmbeddingCollection(tables=[
            EmbeddingConfig(name="hist", embedding_dim=4, num_embeddings=40,
                            feature_names=["h"])])

    def forward(self, bag: KeyedJaggedTensor, seq: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.ebc(bag).values()
        hist = self.ec(seq)["h"].values()
        return pooled.square().sum() + hist.sum()


def unsharded_batch(step: int):
    """(bag, seq) KeyedJaggedTensors for :class:`Unsharded`: user ids < 20, item < 10,
    hist < 15 (the other rows stay cold)."""
    g = torch.Generator().manual_seed(step)
    bag = KeyedJaggedTensor.from_lengths_sync(
        keys=["u", "i"], values=torch.cat([torch.randint(0, 20, (4,), generator=g),
                                           torch.randint(0, 10, (4,), generator=g)]),
        lengths=torch.tensor([2, 2, 1, 3]))
    seq = KeyedJaggedTensor.from_lengths_sync(
        keys=["h"], values=torch.randint(0, 15, (3,), generator=g), lengths=torch.tensor([1, 2]))
    return bag, seq
