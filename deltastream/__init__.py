"""deltastream: stream changed embedding rows from online-learning trainers to predictors.

Names are imported lazily so that torch-free code (``deltastream.wire``, the predictor
package ``consumers``) can import this package on hosts without torch.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

# public name -> submodule that defines it
_EXPORTS = {
    "Slice": "sharding",
    "gen_slice": "sharding",
    "slice_of": "sharding",
    "owner_of": "sharding",
    "TrackingMode": "types",
    "UpdateMode": "types",
    "DeltaRows": "types",
    "HashTable": "embedding.hashtable",
    "normal_initializer": "embedding.initializers",
    "uniform_initializer": "embedding.initializers",
    "constant_initializer": "embedding.initializers",
    "SparseSGD": "embedding.optim",
    "RowWiseAdagrad": "embedding.optim",
    "SparseAdam": "embedding.optim",
    "ShardedEmbedding": "embedding.sharded",
    "ShardedEmbeddingCollection": "embedding.collection",
    "ShardingPlan": "embedding.plan",
    "TablePlan": "embedding.plan",
    "ShardSpec": "embedding.plan",
    "PlanError": "errors",
    "DeltaStore": "tracking.store",
    "DeltaTracker": "tracking.tracker",
    "TorchRecDeltaSource": "tracking.torchrec_interop",
    "Selection": "publishing.selection",
    "select_changed": "publishing.selection",
    "LookupRate": "publishing.lookup_rate",
    "DeltaBatch": "wire",
    "encode": "wire",
    "decode": "wire",
    "WireError": "errors",
    "DeltaPublisher": "publishing.publisher",
    "PublishResult": "publishing.results",
    "PublishError": "errors",
    "ensure_topic": "publishing.topics",
    "TopicError": "errors",
    "Undelivered": "publishing.results",
    "publish_delta": "publishing.rounds",
    "SelectionPolicy": "publishing.rounds",
    "BudgetPolicy": "publishing.budget_policy",
    "BudgetPublisher": "publishing.budget",
    "RoundPolicy": "publishing.round_engine",
    "RoundPublisher": "publishing.round_publisher",
    "DensePublisher": "publishing.dense",
    "DenseOptions": "publishing.dense",
    "EmbeddedBroker": "broker",
    "DeltastreamError": "errors",
    "BrokerError": "errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'deltastream' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
