"""The demo's click model on TorchRec (``deltastream demo --model-kind torchrec``).

The same model as :class:`deltastream_demo.model.CTRModel` —
``logit = MLP(concat[u, v, u*v, dense])`` — with the user and item tables in one TorchRec
``EmbeddingBagCollection`` (tables ``"user"`` and ``"item"``, one id per sample, SUM
pooling), sharded **row-wise** over the trainers by ``DistributedModelParallel`` with
fbgemm's fused ``EXACT_ROWWISE_ADAGRAD`` (the optimizer steps inside the backward). Ids are
the stream's entity indices (``StreamConfig.dense_ids``): ``[0, users)`` and ``[0, items)``.

Rows start at zero (``weight_init_min = weight_init_max = 0``), so a row never trained reads
as zeros on the trainer, as a serving table's missing row does. The MLP is not wrapped in
DDP (``init_data_parallel=False``): the trainer averages its gradients itself, as for the
HashTable model. Importing this module imports TorchRec.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingPlan

from deltastream_demo.model import TABLE_NAMES, click_mlp

__all__ = ["TorchRecCTRModel", "build_dmp", "plan_lines"]

# row-wise sharding's collectives call torch.distributed's deprecated *_tensor spellings;
# the trainer's output would repeat the FutureWarning for every process
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.c10d_logger")


class TorchRecCTRModel(torch.nn.Module):
    """User/item ``EmbeddingBagCollection`` (built on ``meta``: DMP materializes its shards)
    + the MLP on ``device``."""

    def __init__(self, dim: int, n_dense: int, hidden: Sequence[int], rows: dict[str, int],
                 device: torch.device) -> None:
        super().__init__()
        self.dim, self.n_dense = dim, n_dense
        self.ebc = EmbeddingBagCollection(device=torch.device("meta"), tables=[
            EmbeddingBagConfig(name=name, embedding_dim=dim, num_embeddings=int(rows[name]),
                               feature_names=[name], pooling=PoolingType.SUM,
                               weight_init_min=0.0, weight_init_max=0.0)
            for name in TABLE_NAMES])
        self.mlp = click_mlp(dim, n_dense, hidden, device)

    def forward(self, user_ids: torch.Tensor, item_ids: torch.Tensor,
                dense: torch.Tensor) -> torch.Tensor:
        """Click logits ``[B]`` (one id per sample and table)."""
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=list(TABLE_NAMES), values=torch.cat([user_ids, item_ids]),
            lengths=torch.ones(2 * user_ids.numel(), dtype=torch.int32,
                               device=user_ids.device))
        kt = self.ebc(kjt)
        u, v = kt["user"], kt["item"]
        x = torch.cat([u, v, u * v, dense.to(u.dtype)], dim=1)
        return self.mlp(x).squeeze(1)

    def dense_parameters(self) -> list[torch.nn.Parameter]:
        """The MLP's parameters (the tables are updated by the fused kernel)."""
        return list(self.mlp.parameters())


def build_dmp(dim: int, n_dense: int, hidden: Sequence[int], rows: dict[str, int], *,
              lr: float, device: torch.device, world: int
              ) -> tuple[DistributedModelParallel, TorchRecCTRModel]:
    """``(dmp, model)``: :class:`TorchRecCTRModel` sharded row-wise over ``world`` ranks
    (the default process group must be initialized), fused row-wise Adagrad at ``lr``.
    ``model`` is the module DMP wraps (its ``ebc`` now the sharded collection)."""
    net = TorchRecCTRModel(dim, n_dense, hidden, rows, device)
    sharder = EmbeddingBagCollectionSharder(fused_params={
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": float(lr),
        "eps": 1e-8})
    plan = construct_module_sharding_plan(
        net.ebc, {name: row_wise(compute_kernel="fused") for name in TABLE_NAMES},
        sharder=sharder, world_size=world, local_size=world, device_type=device.type)
    dmp = DistributedModelParallel(net, device=device, plan=ShardingPlan({"ebc": plan}),
                                   sharders=[sharder], init_data_parallel=False)
    return dmp, net


def plan_lines(dmp: DistributedModelParallel) -> list[str]:
    """The plan, one line per table: ``"user (dim 16, torchrec row_wise): s0 r0 rows 0-2000
    | s1 r1 rows 2000-4000"``."""
    lines = []
    for name, ps in sorted(dmp.plan.plan["ebc"].items(), key=lambda kv: TABLE_NAMES.index(
            kv[0])):
        shards = [f"s{j} r{s.placement.rank()} rows {s.shard_offsets[0]}-"
                  f"{s.shard_offsets[0] + s.shard_sizes[0]}"
                  for j, s in enumerate(ps.sharding_spec.shards)]
        dim = ps.sharding_spec.shards[0].shard_sizes[1]
        lines.append(f"{name} (dim {dim}, torchrec {ps.sharding_type}): " + " | ".join(shards))
    return lines
