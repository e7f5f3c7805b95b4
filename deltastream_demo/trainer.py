"""The demo's trainer process: rank ``r`` of ``W`` trains the CTR model and publishes deltas.

:func:`trainer_main` runs in its own process (``multiprocessing`` spawn). Per step it trains
on its share of the global batch (the stream's examples ``[(step·W + r)·B, … + B)``): the
embedding tables are :class:`~deltastream.ShardedEmbedding` (rank ``r`` owns the rows of its
slice range; lookups and gradients travel by ``torch.distributed``; with ``--model-kind
torchrec`` a TorchRec ``EmbeddingBagCollection`` sharded row-wise by DMP, its fused optimizer
stepping in the backward: :mod:`deltastream_demo.torchrec_model`), the dense gradients are
averaged with one ``all_reduce`` that also carries the loss and the stop flag (so every rank
stops at the same step when ``--duration`` runs out).

A :class:`~deltastream.DeltaTracker` in EMBEDDING mode watches the local shards with two
consumers:

* ``publish`` — with ``publish_budget`` > 0 (bytes/s), a
  :class:`~deltastream.BudgetPublisher` ticked after every step: the rows with the most
  serving error per byte, across tables, within the budget (its rounds run on the
  publisher's worker, off the training loop); the rest stays pending. Otherwise a
  :class:`~deltastream.RoundPublisher` ticked after every step: every ``publish_every``
  steps the round :func:`deltastream.publish_delta` would run (``select_changed``, top
  ``topk_fraction`` by drift, new rows first; ``retain`` the leftover), on its worker too
  (rounds coalesce when the worker falls behind). Either way
  ``DeltaPublisher.publish`` per table (shard = rank, so the rows go to partition
  ``rank % partitions``);
* ``snapshot`` — every ``snapshot_every`` steps: the rows changed since the last snapshot are
  copied into a mirror of this shard (:class:`~consumers.ServingTable` s) and written as a
  base snapshot (``consumers.storage.snapshot.write_snapshot``) together with the publisher's next
  offset and seq state, so a new predictor can start from it (``SyncDaemon(base=...)``).

The MLP is replicated on every rank (its gradients are all-reduced), so one rank publishes
it: a :class:`~deltastream.DensePublisher` (``DenseOptions(rank=0)``, a version every
``dense_every`` steps) ticked by the publish path above (the publisher's ``dense=``), on
the same :class:`~deltastream.DeltaPublisher` as the rows; the final flush sends a last
full version. The predictor scores with the versions it assembles from the stream.

Every ``eval_every`` steps (progressive validation) the ranks score the next
``eval_examples`` of the stream — not trained on yet — together; rank 0 sends the AUC, and
the parent forwards it to the predictor, which scores the same examples with its serving
tables and the dense version it holds at once: serving against trainer AUC over the run.

After the last step: a final flush publishes every retained row and a full dense version,
the held-out slice is scored with the trainer's own (torch) model, and the shard's rows, the
ids it published and the MLP weights are dumped (``.npz``) for the predictor's comparison
lines (the trainer's AUC and row drift; never what the predictor serves with).
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import signal
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from deltastream.clilog import setup_logging
from deltastream.kafka_config import secret_values
from deltastream_demo.batches import BatchPrefetcher
from deltastream_demo.trainer_publishing import SNAPSHOT_PREFIX, TrainerPublishing

__all__ = ["trainer_main", "SNAPSHOT_PREFIX"]

log = logging.getLogger(__name__)

_EVAL_CHUNK = 8192


def trainer_main(rank: int, cfg: dict, events: Any) -> None:
    """Entry point of trainer ``rank`` (see the module docstring).

    ``cfg`` keys: world, master_port, device, bootstrap_servers, topic, model_name, dim,
    hidden, batch_size, steps (or None), duration (s or None), publish_every,
    snapshot_every, eval_every (steps, 0 = off), eval_examples, dense_every (steps),
    topk_fraction,
    publish_budget (bytes/s, 0 = rounds), wire_dtype, max_message_bytes, lr_sparse, lr_dense,
    seed, stream (StreamConfig kwargs), heldout, work_dir, snapshot_dir, t0, log_level,
    verbose, threads, kafka_config (kafka-python security settings), sharding, model_kind
    (``"torchrec"``: :mod:`deltastream_demo.torchrec_model`). ``events``: queue to the
    parent.
    """
    # Ctrl-C reaches the whole process group: the parent stops this process, quietly
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_logging(cfg.get("log_level", "WARNING"), verbose=bool(cfg.get("verbose")),
                  fmt=f"%(asctime)s %(levelname)s trainer{rank} %(name)s: %(message)s",
                  secrets=secret_values(cfg.get("kafka_config") or {}))
    try:
        _Trainer(rank, cfg, events).run()
    except BaseException as e:
        log.exception("trainer %d failed", rank)
        events.put({"kind": "error", "who": f"trainer {rank}",
                    "error": f"{type(e).__name__}: {e}"})
        raise SystemExit(1) from None


class _Trainer:
    def __init__(self, rank: int, cfg: dict, events: Any) -> None:
        import torch
        import torch.distributed as dist

        from deltastream import DeltaTracker, RowWiseAdagrad, TrackingMode

        self.torch, self.dist = torch, dist
        self.rank, self.cfg, self.events = rank, cfg, events
        self.world = int(cfg["world"])
        torch.set_num_threads(int(cfg.get("threads", 1)))
        self._join_process_group()
        torch.manual_seed(int(cfg["seed"]))  # same MLP init on every rank
        self._build_model()
        self.sparse_opt = None if self.torchrec else RowWiseAdagrad(
            self.model, lr=float(cfg["lr_sparse"]))
        self.dense = self.net.dense_parameters()
        # fused: one kernel for the whole MLP (on CPU 44 µs a step against 155 µs for the
        # per-tensor loop; on CUDA one launch instead of one per op and tensor)
        self.dense_opt = torch.optim.Adam(self.dense, lr=float(cfg["lr_dense"]), fused=True)
        # a snapshot writes the rows' current values: it reads ids only (no FIRST rows kept
        # or merged for it)
        self.tracker = DeltaTracker(self.model, consumers=["publish", "snapshot"],
                                    delete_on_read=True, mode=TrackingMode.EMBEDDING,
                                    id_only_consumers=["snapshot"])
        # tracker key -> table (a HashTable, or a TorchRecTable: a row-wise shard)
        self.fqn_table = (dict(self.tracker.get_tracked_modules()) if self.torchrec else
                          {fqn: self.model.get_submodule(fqn) for fqn in self._tracked_fqns()})
        self.pub = TrainerPublishing(rank, cfg, events, self.tracker, self.fqn_table,
                                     self.net.mlp, self.table_names, self.plan is None)
        self.work = Path(cfg["work_dir"])
        # with --prefetch, the next step's batch is made on a thread while this one trains
        self.batches = BatchPrefetcher(self.stream, self.rank, self.world,
                                       int(cfg["batch_size"]), self.device, torch,
                                       ahead=bool(cfg.get("prefetch", False)))

    def _join_process_group(self) -> None:
        """Pick this rank's device and join the process group (NCCL on CUDA, else gloo)."""
        torch, cfg = self.torch, self.cfg
        if cfg["device"] == "cuda":
            self.device = torch.device("cuda", self.rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
            backend = "nccl"
        else:
            self.device = torch.device("cpu")
            backend = "gloo"
        self.dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{cfg['master_port']}", rank=self.rank,
            world_size=self.world,
            timeout=datetime.timedelta(seconds=float(cfg.get("dist_timeout", 120))))

    def _build_model(self) -> None:
        """The click stream and this rank's model: ``model`` (what trains and is tracked),
        ``net`` (its MLP side), ``tables`` (local shards), ``plan``, ``table_names``."""
        from deltastream_demo.data import ClickStream, StreamConfig
        from deltastream_demo.model import TABLE_NAMES, CTRModel, local_tables

        cfg = self.cfg
        self.stream = ClickStream(StreamConfig(**cfg["stream"]))
        # --model-kind torchrec: a DMP-sharded EmbeddingBagCollection, its fused optimizer
        # steps in the backward (no sparse optimizer here); the tables are TorchRecTables
        self.torchrec = cfg.get("model_kind") == "torchrec"
        self.model_plan: Optional[list[str]] = None
        if self.torchrec:
            from deltastream_demo.torchrec_model import build_dmp, plan_lines

            self.model, self.net = build_dmp(
                int(cfg["dim"]), self.stream.config.n_dense, tuple(cfg.get("hidden", (64, 32))),
                {"user": self.stream.config.n_users, "item": self.stream.config.n_items},
                lr=float(cfg["lr_sparse"]), device=self.device, world=self.world)
            self.model_plan = plan_lines(self.model)
        else:
            self.model = self.net = CTRModel(
                int(cfg["dim"]), self.stream.config.n_dense, tuple(cfg.get("hidden", (64, 32))),
                sharded=True, device=self.device, seed=int(cfg["seed"]) * 1000 + self.rank,
                sharding=cfg.get("sharding", "row"))
        self.tables = local_tables(self.model)  # name -> local HashTable shard
        # --sharding table|column: shards are named "<table>#<j>"; rows are reported (dump,
        # rows_held) per table by the rank holding shard 0, read whole through the plan
        self.plan = getattr(self.model, "plan", None) if not self.torchrec else None
        self.table_names = (tuple(TABLE_NAMES) if self.plan is not None or self.torchrec
                            else tuple(self.tables))

    # ------------------------------------------------------------------ helpers

    def _tracked_fqns(self) -> list[str]:
        """FQNs of the local HashTables (what the tracker reports deltas under)."""
        from deltastream import HashTable

        return [fqn for fqn, m in self.model.named_modules() if isinstance(m, HashTable)]

    # ------------------------------------------------------------------ training

    def _kernels(self) -> bool:
        """Whether deltastream's Triton kernels ran the tables' updates (CUDA fast path)."""
        from deltastream.kernels.runtime import use_kernels

        return any(use_kernels(t.storage) for t in self.tables.values())

    def _train_step(self, step: int, stop: bool) -> tuple[Any, Any]:
        """One step on every rank (collective). Returns the mean loss and the stop flag
        (anyone's ``stop``) as 0-d tensors on the device, unread: reading either is a host
        sync on CUDA, so the loop reads the loss when it reports and the flag only when a
        rank can ask to stop (``--duration``)."""
        torch, dist = self.torch, self.dist
        u, i, x, y = self.batches.get(step)
        logits = self.model(u, i, x)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y)
        loss.backward()
        # one all_reduce: dense gradients, the loss and the stop flag
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.dense]
        flat = torch.cat([g.reshape(-1) for g in grads]
                         + [loss.detach().reshape(1),
                            torch.tensor([1.0 if stop else 0.0], device=self.device)])
        if self.world > 1:  # one rank: the sum is its own (gloo would still copy it)
            dist.all_reduce(flat)
            flat[:-1] /= self.world
        off = 0
        for p, g in zip(self.dense, grads, strict=True):
            n = g.numel()
            p.grad = flat[off:off + n].view_as(p)
            off += n
        if self.sparse_opt is not None:
            self.sparse_opt.step()
            self.sparse_opt.zero_grad()
        self.dense_opt.step()
        self.dense_opt.zero_grad(set_to_none=True)
        self.tracker.step()
        return flat[-2], flat[-1]

    def _heldout_scores(self, start: int, n: Optional[int] = None
                        ) -> tuple[np.ndarray, np.ndarray]:
        """This rank's share (positions ``[k]``, logits ``[k]``) of the held-out slice of
        ``n`` examples (default ``heldout``) from ``start``, scored by the torch model
        (collective)."""
        torch = self.torch
        n = int(self.cfg["heldout"]) if n is None else int(n)
        ho = self.stream.batch(start, n, salt=1)
        mine = np.arange(self.rank, n, self.world)
        chunks = max(1, math.ceil(n / (self.world * _EVAL_CHUNK)))
        out = []
        self.model.eval()
        try:
            with torch.no_grad(), self.tracker.pause():
                for idx in np.array_split(mine, chunks):  # same call count on every rank
                    lg = self.model(torch.from_numpy(ho.user_ids[idx]).to(self.device),
                                    torch.from_numpy(ho.item_ids[idx]).to(self.device),
                                    torch.from_numpy(ho.dense[idx]).to(self.device))
                    out.append(lg.float().cpu().numpy())
        finally:
            self.model.train()
        return mine.astype(np.int64), (np.concatenate(out) if out else np.empty(0, np.float32))

    def evaluate(self, step: int) -> None:
        """Progressive validation during training (collective): score the next
        ``eval_examples`` of the stream, which no rank has trained on yet, with the torch
        model; rank 0 sends the AUC, so the predictor can score the same examples with its
        serving tables and dense version now (how far serving lags the trainer)."""
        from deltastream_demo.scoring import auc

        torch = self.torch
        n = int(self.cfg["eval_examples"])
        start = step * self.world * int(self.cfg["batch_size"])
        pos, logits = self._heldout_scores(start, n)
        full = torch.zeros(n, dtype=torch.float32, device=self.device)
        full[torch.from_numpy(pos).to(self.device)] = torch.from_numpy(logits).to(self.device)
        self.dist.all_reduce(full)  # each position is scored by exactly one rank
        if self.rank != 0:
            return
        labels = self.stream.batch(start, n, salt=1).labels
        self.events.put({"kind": "eval", "step": step, "start": start, "n": n,
                         "t": time.time() - float(self.cfg["t0"]),
                         "auc": auc(labels, full.cpu().numpy())})

    def _held_rows(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """``{table: (ids, full rows)}`` this rank reports. Row sharding: its shards. A plan:
        the ids of the tables whose shard 0 is here, rows read whole through the plan
        (collective: every rank calls it)."""
        if self.torchrec:
            return self._torchrec_rows()
        if self.plan is None:
            return {name: (tbl.ids().cpu().numpy(), tbl.embeddings().float().cpu().numpy())
                    for name, tbl in self.tables.items()}
        torch = self.torch
        feats = {}
        for name in self.table_names:
            first = self.tables.get(f"{name}#0")
            feats[name] = first.ids() if first is not None else torch.zeros(
                0, dtype=torch.int64, device=self.device)
        self.model.eval()
        try:
            with torch.no_grad(), self.tracker.pause():
                rows = self.model.emb(feats)
        finally:
            self.model.train()
        return {n: (feats[n].cpu().numpy(), rows[n].float().cpu().numpy()) for n in feats}

    def _torchrec_rows(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """``{table: (global ids, rows)}`` of this rank's row-wise shards: every row that
        moved off its zero init, and every row this rank published."""
        torch = self.torch
        out = {}
        for tbl in self.fqn_table.values():
            with torch.no_grad():
                moved = torch.nonzero(tbl.weight.abs().sum(dim=1) > 0).flatten()
            pub = self.pub.published_ids[tbl.name]
            ids = np.union1d((moved + int(tbl.row_offset)).cpu().numpy(),
                             np.concatenate(pub) if pub else np.empty(0, np.int64))
            rows = tbl.lookup(torch.from_numpy(ids.astype(np.int64)).to(self.device))
            out[tbl.name] = (ids.astype(np.int64), rows.detach().float().cpu().numpy())
        return out

    def _dump(self, pos: np.ndarray, logits: np.ndarray,
              held: dict[str, tuple[np.ndarray, np.ndarray]]) -> str:
        from deltastream_demo.model import export_dense

        arrays: dict[str, np.ndarray] = {}
        for name, (ids, rows) in held.items():
            arrays[f"ids/{name}"] = ids
            arrays[f"rows/{name}"] = rows
            pub = self.pub.published_ids[name]
            arrays[f"published/{name}"] = (np.unique(np.concatenate(pub)) if pub
                                           else np.empty(0, np.int64))
        for k, v in export_dense(self.net).items():
            arrays[f"dense/{k}"] = v
        arrays["heldout/pos"] = pos
        arrays["heldout/logit"] = logits
        path = self.work / f"trainer-{self.rank}.npz"
        tmp = path.with_suffix(f".tmp-{os.getpid()}.npz")
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
        return str(path)

    def run(self) -> None:
        cfg = self.cfg
        steps = cfg.get("steps")
        duration = cfg.get("duration")
        eval_every = int(cfg.get("eval_every") or 0)
        snap_every = int(cfg["snapshot_every"])
        pub = self.pub
        self.events.put({"kind": "ready", "who": f"trainer {self.rank}", "rank": self.rank})
        self.dist.barrier()
        t0 = time.monotonic()
        last_report = 0.0
        step, loss, stop = 0, float("nan"), False
        losses: list[tuple[int, float]] = []
        # seconds of the loop per part (the report's "where the training loop's time went")
        split = dict.fromkeys(("train", "publish", "snapshots", "evaluations"), 0.0)
        while not stop and (steps is None or step < steps):
            t_step = time.monotonic()
            want_stop = duration is not None and t_step - t0 >= float(duration)
            loss_t, stop_t = self._train_step(step, want_stop)
            stop = duration is not None and bool(stop_t > 0)
            step += 1
            t_pub = time.monotonic()
            split["train"] += t_pub - t_step
            pub.publish_round(step)  # a tick: a hand-off when a round is due
            t_snap = time.monotonic()
            split["publish"] += t_snap - t_pub
            if step % snap_every == 0 and self.plan is None:
                pub.snapshot_round(step)
            t_eval = time.monotonic()
            split["snapshots"] += t_eval - t_snap
            if eval_every and step % eval_every == 0 and not stop:
                self.evaluate(step)
            now = time.monotonic()
            split["evaluations"] += now - t_eval
            if self.rank == 0 and (now - last_report >= 0.25 or step == steps):
                last_report = now
                loss = float(loss_t)
                losses.append((step, loss))
                self.events.put({"kind": "train", "rank": 0, "step": step, "loss": loss,
                                 "examples": step * self.world * int(cfg["batch_size"]),
                                 "t": time.time()})
        train_s = time.monotonic() - t0
        self.batches.close()
        if step:
            loss = float(loss_t)
        # ---- final flush: everything still retained goes out now
        t_flush = time.monotonic()
        pub.final_flush(step)
        flush_s = time.monotonic() - t_flush
        left = sum(len(d) for d in self.tracker.get_delta("publish").values())
        heldout_start = step * self.world * int(cfg["batch_size"])
        pos, logits = self._heldout_scores(heldout_start)
        held = self._held_rows()
        dump = self._dump(pos, logits, held)
        pstats, rstats = pub.publisher.stats(), pub.rounds_pub.stats()
        pub.publisher.close()
        tstats = self.tracker.stats() if hasattr(self.tracker, "stats") else {}
        self.events.put({
            "kind": "final", "rank": self.rank, "steps": step,
            "device": str(self.device), "kernels": self._kernels(),
            "examples": step * self.world * int(cfg["batch_size"]),
            "train_seconds": train_s, "flush_seconds": flush_s, "final_loss": loss,
            "loop_split": split,
            "losses": losses, "rounds": pub.rounds, "totals": pub.totals,
            "bounds": pub.bounds,
            "left_after_flush": int(left),
            # hand-offs that waited for a busy worker: their rows went out in a later round
            "deferred_ticks": int(rstats["deferred_ticks"]),
            "offsets": {**pub.other_offsets, pub.partition: int(pub.next_offset)},
            "dump": dump, "heldout_start": heldout_start, "snapshots": pub.snapshots,
            "rows_held": {n: len(ids) for n, (ids, _) in held.items()},
            "tracker": _plain(tstats), "publisher": _plain(pstats),
            "epoch": pub.publisher.epoch,
            "dense": _plain(pub.dense_pub.stats()),
            "budget": _plain(rstats) if pub.budgeted else None,
            **({} if self.plan is None else {"plan": self.plan.describe()}),
            **({} if self.model_plan is None else {"model_plan": self.model_plan}),
        })
        self.dist.barrier()
        self.dist.destroy_process_group()


def _plain(x: Any) -> Any:
    """JSON-able copy (tensors and numpy scalars to Python numbers, keys to str)."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if hasattr(x, "item") and callable(x.item) and getattr(x, "ndim", 1) == 0:
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    if hasattr(x, "value") and hasattr(x, "name"):  # enums
        return x.value
    return x
