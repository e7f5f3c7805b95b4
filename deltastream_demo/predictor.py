"""The demo's predictor process: a :class:`~consumers.SyncDaemon` plus scoring. No torch.

:func:`predictor_main` runs in its own process (``multiprocessing`` spawn). It

1. writes an empty *base* snapshot holding the topic's current end offsets and starts the
   daemon from it, so the predictor serves exactly this run's messages even on a topic that
   already holds older ones (an external Kafka);
2. runs the daemon in a thread and reports lag, rows applied and freshness to the parent
   every ``progress_interval`` seconds; on each ``eval`` (the trainer's AUC at a step)
   scores the same examples with the serving tables and the dense version the daemon
   has assembled from the stream, as they are at that moment (:func:`serving_eval`), so the
   report shows serving against trainer AUC over the run and the dense version's age;
3. on ``finish`` (the trainers' final offsets): waits until it has applied everything up to
   them, stops the daemon (final checkpoint), then scores the held-out slice of the stream
   with (a) the **serving** tables under the newest streamed dense version
   (``daemon.dense()``), (b) the trainers' own rows under the trainers' own MLP (their
   ``.npz`` dumps: the comparison line, never what is served), and measures
   trainer-vs-serving row drift for every published id;
4. starts a second, fresh daemon from the trainers' latest base snapshots (merged into one
   directory) and checks that it converges to the trainers' rows too;
5. sends a ``result`` message and exits. The result records whether torch was ever imported
   in this process (it must not be).

Freshness per applied message (``now − ts``, ``ts`` = when the trainer read the rows) is
recorded by :class:`ApplyLog`, the daemon's ``on_apply`` hook.
"""

from __future__ import annotations

import functools
import logging
import math
import queue
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from consumers.serving.table import ServingTable
from consumers.storage.snapshot import read_snapshot, write_snapshot
from consumers.sync import SyncDaemon
from deltastream.clilog import setup_logging
from deltastream.kafka_config import secret_values
from deltastream_demo.data import ClickStream, StreamConfig
from deltastream_demo.scoring import (
    DenseWeights,
    RowTable,
    auc,
    logloss,
    score,
    weights_from_state_dict,
)

__all__ = [
    "ApplyLog",
    "write_start_base",
    "serving_eval",
    "row_tolerance",
    "compare_rows",
    "predictor_main",
]

log = logging.getLogger(__name__)

#: worst-case relative rounding error of each wire dtype (see deltastream.wire)
_REL_ERR = {"f32": 0.0, "f16": 2.0 ** -11, "bf16": 2.0 ** -8}


class ApplyLog:
    """Per applied message: wall time, freshness (s), rows, table and shard. Thread-safe.

    ``t`` are wall-clock seconds (``time.time()``); freshness is ``t - ts/1e9``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._t: list[float] = []
        self._fresh: list[float] = []
        self._rows: list[int] = []
        self._tables: list[str] = []

    def __call__(self, outcome: Any, partition: int = -1, offset: int = -1) -> None:
        """``SyncDaemon(on_apply=...)`` hook: log ``outcome`` (partition/offset unused)."""
        self.add(outcome)

    def add(self, outcome: Any) -> None:
        """Record one :class:`consumers.applier.Outcome` (only ``applied`` ones count)."""
        if getattr(outcome, "kind", None) != "applied" or getattr(outcome, "ts", None) is None:
            return
        now = time.time()
        with self._lock:
            self._t.append(now)
            self._fresh.append(now - outcome.ts / 1e9)
            self._rows.append(int(getattr(outcome, "rows", 0) or 0))
            self._tables.append(str(getattr(outcome, "table", "")))

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(wall times ``[m]``, freshness s ``[m]``, rows ``[m]``) of the messages so far."""
        with self._lock:
            return (np.asarray(self._t, np.float64), np.asarray(self._fresh, np.float64),
                    np.asarray(self._rows, np.int64))

    def tables(self) -> list[str]:
        """Table name of each logged message (aligned with :meth:`arrays`)."""
        with self._lock:
            return list(self._tables)

    def __len__(self) -> int:
        with self._lock:
            return len(self._t)


def write_start_base(path: Path, bootstrap_servers: str, topic: str,
                     kafka_config: Optional[dict] = None) -> dict[int, int]:
    """Write an empty base snapshot at the topic's current end offsets; return them."""
    from consumers.topic import TopicReader

    with TopicReader(bootstrap_servers, topic, timeout=15.0, **(kafka_config or {})) as reader:
        ends = reader.end_offsets()
    write_snapshot(path, tables={}, offsets=ends, seqs={},
                   meta={"kind": "deltastream-demo-start", "topic": topic})
    return ends


def row_tolerance(trainer_rows: np.ndarray, wire_dtype: str) -> np.ndarray:
    """Per-element bound of ``|serving − trainer|`` for rows sent in ``wire_dtype``.

    f16/bf16: relative rounding (plus f16's subnormal absolute step); i8: half a quantization
    step of the row (``max|row| / 254``); f32: exact.
    """
    x = np.abs(np.asarray(trainer_rows, np.float64))
    if wire_dtype == "i8":
        top = x.max(axis=1, keepdims=True) if x.size else x
        # half a quantization step, plus float32 rounding of scale and of q × scale
        return np.broadcast_to(top / 254.0 + top * 2.0 ** -20 + 1e-12, x.shape)
    if wire_dtype not in _REL_ERR:
        raise ValueError(f"unknown wire dtype {wire_dtype!r}")
    absolute = 2.0 ** -25 if wire_dtype == "f16" else 0.0
    return x * _REL_ERR[wire_dtype] * (1 + 1e-6) + absolute


def compare_rows(ids: np.ndarray, serving: Any, trainer: RowTable, wire_dtype: str) -> dict:
    """Drift of the serving rows of ``ids`` against the trainer's rows.

    Returns counts (ids compared, missing in serving / in the trainer), RMSE and max of the
    element-wise difference, the tolerance (largest per-element bound) and how many elements
    exceed their own bound.
    """
    ids = np.asarray(ids, np.int64)
    in_serving = serving.contains(ids) if ids.size else np.zeros(0, bool)
    in_trainer = trainer.contains(ids) if ids.size else np.zeros(0, bool)
    both = ids[in_serving & in_trainer]
    s = serving.lookup(both).astype(np.float64) if both.size else np.zeros((0, trainer.dim))
    t = trainer.lookup(both).astype(np.float64) if both.size else np.zeros((0, trainer.dim))
    diff = np.abs(s - t)
    bound = row_tolerance(t, wire_dtype)
    return {
        "ids_compared": int(both.size),
        "missing_in_serving": int((~in_serving).sum()),
        "missing_in_trainer": int((in_serving & ~in_trainer).sum()),
        "rmse": float(np.sqrt(np.mean(diff ** 2))) if diff.size else 0.0,
        "max_abs": float(diff.max()) if diff.size else 0.0,
        "tolerance": float(bound.max()) if bound.size else 0.0,
        "violations": int((diff > bound).sum()),
    }


# --------------------------------------------------------------------------- the process


def _quantiles(x: np.ndarray) -> dict:
    if x.size == 0:
        return {"p50": None, "p95": None, "p99": None, "max": None, "mean": None, "samples": 0}
    p50, p95, p99 = np.quantile(x, [0.5, 0.95, 0.99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99), "max": float(x.max()),
            "mean": float(x.mean()), "samples": int(x.size)}


def _load_trainer(dumps: list[str], dim: int) -> tuple[dict, dict[str, RowTable], dict, dict]:
    """The trainer's MLP, trainer RowTables, published ids per table and torch held-out
    scores (the comparison side: nothing here is served)."""
    parts: dict[str, list] = {}
    published: dict[str, list] = {}
    weights: dict[str, np.ndarray] = {}
    torch_scores: dict[str, list] = {"pos": [], "logit": []}
    for path in dumps:
        with np.load(path, allow_pickle=False) as z:
            names = sorted({k.split("/", 1)[1] for k in z.files if k.startswith("ids/")})
            for name in names:
                parts.setdefault(name, []).append((z[f"ids/{name}"], z[f"rows/{name}"]))
                published.setdefault(name, []).append(z[f"published/{name}"])
            if not weights:
                weights = {k.split("/", 1)[1]: z[k] for k in z.files if k.startswith("dense/")}
            if "heldout/pos" in z.files:
                torch_scores["pos"].append(z["heldout/pos"])
                torch_scores["logit"].append(z["heldout/logit"])
    tables = {n: RowTable.concat(p, dim) for n, p in parts.items()}
    pub = {n: np.unique(np.concatenate(v)) if v else np.empty(0, np.int64)
           for n, v in published.items()}
    return weights, tables, pub, torch_scores


def _drift(daemon_tables: dict[str, ServingTable], trainer: dict[str, RowTable],
           published: dict[str, np.ndarray], wire_dtype: str) -> dict:
    per_table = {}
    for name, ids in published.items():
        serving = daemon_tables.get(name) or ServingTable(name, trainer[name].dim)
        per_table[name] = compare_rows(ids, serving, trainer[name], wire_dtype)
        # ids the trainer holds but never published (must be none after the final flush)
        never = ~np.isin(trainer[name].ids(), ids, assume_unique=True)
        per_table[name]["trainer_ids_unpublished"] = int(never.sum())
        # ids served that the trainer never published (must be none: no stale topic data)
        per_table[name]["extra_in_serving"] = int((~np.isin(serving.ids(), ids)).sum())
    tot: dict[str, Any] = {"tables": per_table}
    for k in ("ids_compared", "missing_in_serving", "missing_in_trainer", "violations",
              "trainer_ids_unpublished", "extra_in_serving"):
        tot[k] = int(sum(t[k] for t in per_table.values()))
    n_el = sum(t["ids_compared"] for t in per_table.values())
    if n_el:
        tot["rmse"] = float(math.sqrt(sum(t["rmse"] ** 2 * t["ids_compared"]
                                          for t in per_table.values()) / n_el))
    else:
        tot["rmse"] = 0.0
    tot["max_abs"] = max((t["max_abs"] for t in per_table.values()), default=0.0)
    tot["tolerance"] = max((t["tolerance"] for t in per_table.values()), default=0.0)
    tot["wire_dtype"] = wire_dtype
    return tot


def _served_weights(view: Any) -> Optional[DenseWeights]:
    """The click MLP of a streamed dense version (None: no version yet, or none with the
    MLP)."""
    return None if view is None else weights_from_state_dict(view.tensors)


@functools.lru_cache(maxsize=1)
def _stream(config: StreamConfig) -> ClickStream:
    """The click stream of ``config``, built once: every evaluation reads the same one
    (its hidden model and the session roots it remembers)."""
    return ClickStream(config)


def _score_all(cfg: dict, trainer_weights: DenseWeights, serving: dict[str, ServingTable],
               trainer: dict[str, RowTable], torch_scores: dict,
               served: Optional[DenseWeights]) -> dict:
    """AUCs of the held-out examples: the serving tables under the dense version streamed
    to the predictor (``served``; None: no serving AUC, and ``dense_source`` "none"), and
    the trainer's tables under the trainer's own MLP (the comparison line)."""
    ho = _stream(StreamConfig(**cfg["stream"])).batch(cfg["heldout_start"], cfg["heldout"],
                                                       salt=1)
    trainer_logits = score(trainer_weights, trainer["user"].lookup, trainer["item"].lookup,
                           ho.user_ids, ho.item_ids, ho.dense)
    out = {
        "examples": len(ho),
        "heldout_start": cfg["heldout_start"],
        "serving": None,
        "trainer": auc(ho.labels, trainer_logits),
        "ceiling": auc(ho.labels, ho.true_logits),
        "logloss_trainer": logloss(ho.labels, trainer_logits),
        "click_rate": float(ho.labels.mean()),
        "dense_source": "none",
    }
    if served is not None:
        zeros = RowTable(np.empty(0, np.int64), np.empty((0, cfg["dim"]), np.float32))
        serving_logits = score(served, (serving.get("user") or zeros).lookup,
                               (serving.get("item") or zeros).lookup, ho.user_ids,
                               ho.item_ids, ho.dense)
        out.update(serving=auc(ho.labels, serving_logits), dense_source="stream",
                   logloss_serving=logloss(ho.labels, serving_logits),
                   max_logit_diff=float(np.abs(serving_logits - trainer_logits).max()))
    if torch_scores["pos"]:
        pos = np.concatenate(torch_scores["pos"])
        lg = np.concatenate(torch_scores["logit"])
        order = np.argsort(pos)
        lg = lg[order]
        if lg.size == len(ho):
            out["trainer_torch"] = auc(ho.labels, lg)
            out["numpy_vs_torch_max_diff"] = float(np.abs(lg - trainer_logits).max())
    return out


def _same_dense(a: Any, b: Any) -> bool:
    """Whether two dense versions are the same version with equal tensors."""
    return a is not None and b is not None and a.version == b.version and \
        sorted(a.tensors) == sorted(b.tensors) and all(
            np.array_equal(a[k], b[k]) for k in a.tensors)


def _bootstrap_check(cfg: dict, trainer: dict[str, RowTable], main_tables: dict,
                     main_dense: Any) -> dict:
    """Start a fresh daemon from the merged latest base snapshots; compare its rows and
    dense version (``main_dense``: the main predictor's) after catch-up."""
    snaps = sorted(Path(cfg["snapshot_dir"]).glob("shard-*"))
    snaps = [p for p in snaps if p.is_dir() and not p.name.endswith((".old",))
             and ".tmp" not in p.name]
    if not snaps:
        return {"skipped": "no snapshot was written (--snapshot-every larger than the run?)"}
    work = Path(cfg["work_dir"])
    steps = [read_snapshot(p).meta.get("step") for p in snaps]
    t0 = time.monotonic()
    # one base per trainer shard: the daemon merges them (disjoint ids and partitions)
    d = SyncDaemon(cfg["bootstrap_servers"], cfg["topic"], model=cfg["model_name"],
                   state_dir=work / "bootstrap-state", base=snaps, summary_interval=0,
                   checkpoint_interval=60.0, **(cfg.get("kafka_config") or {}))
    base_ids = sum(len(t) for t in d.tables().values())  # before it read anything
    try:
        ok = d.catch_up(timeout=60.0)
        st = d.stats()
    finally:
        d.stop()
    tables = d.tables()
    # the snapshots hold no dense state: the fresh daemon assembles the versions after them
    dense = d.dense()
    out = {"dense_step": None if dense is None else dense.step,
           "dense_same_as_main": _same_dense(dense, main_dense),
           "snapshot_steps": steps, "base_ids": base_ids, "caught_up": bool(ok),
           "seconds": time.monotonic() - t0, "messages": st["messages"],
           "gaps": st["gaps"], "duplicates": st["duplicates"]}
    # every trainer row must be there; values within the wire tolerance (rows published after
    # the snapshot came over the wire; older ones are the snapshot's exact f32 copies)
    ids_all, max_abs, viol, missing, n = 0, 0.0, 0, 0, 0
    main_max = 0.0
    for name, tr in trainer.items():
        ids = tr.ids()
        serving = tables.get(name) or ServingTable(name, tr.dim)
        c = compare_rows(ids, serving, tr, cfg["wire_dtype"])
        ids_all += ids.size
        n += c["ids_compared"]
        missing += c["missing_in_serving"]
        max_abs = max(max_abs, c["max_abs"])
        viol += c["violations"]
        main = main_tables.get(name)
        if main is not None and ids.size:
            main_max = max(main_max, float(np.abs(serving.lookup(ids)
                                                  - main.lookup(ids)).max()))
    out.update({"ids": n, "missing": missing, "max_abs": max_abs, "violations": viol,
                "max_abs_vs_main_predictor": main_max})
    return out


def predictor_main(cfg: dict, events: Any, control: Any) -> None:
    """Entry point of the predictor process (see the module docstring).

    ``cfg`` keys: bootstrap_servers, topic, model_name, state_dir, work_dir, snapshot_dir,
    dim, wire_dtype, stream (StreamConfig kwargs), heldout, progress_interval, t0 (wall
    start), log_level, verbose, kafka_config (kafka-python security settings). ``events``:
    queue to the parent; ``control``: queue from it.
    """
    # Ctrl-C reaches the whole process group: the parent stops this process, quietly
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_logging(cfg.get("log_level", "WARNING"), verbose=bool(cfg.get("verbose")),
                  fmt="%(asctime)s %(levelname)s predictor %(name)s: %(message)s",
                  secrets=secret_values(cfg.get("kafka_config") or {}))
    try:
        _predictor(cfg, events, control)
    except BaseException as e:  # the parent must learn why, not just see an exit code
        log.exception("predictor failed")
        events.put({"kind": "error", "who": "predictor", "error": f"{type(e).__name__}: {e}"})
        raise SystemExit(1) from None


def serving_eval(msg: dict, daemon: SyncDaemon, cfg: dict) -> dict:
    """A ``serve_eval`` event: the AUC of the serving tables as they are now under the
    dense version the daemon serves now, on the ``n`` examples from ``start`` that the
    trainer scored at step ``step`` (the request reaches the predictor later: its state may
    be newer than ``step``); ``lag`` = messages not applied yet; ``dense_step`` (the
    version's step), ``dense_age_steps`` (the newest row step applied − its step, read at
    the same instant: ``daemon.consistent()``) and ``dense_age_s`` (now − its trainer
    clock). Before the first dense version: ``auc`` and the dense figures None."""
    now = time.time()
    out = {"kind": "serve_eval", "step": int(msg["step"]), "t": now - float(cfg["t0"]),
           "lag": daemon.stats()["lag_total"], "auc": None, "dense_step": None,
           "dense_age_steps": None, "dense_age_s": None}
    pair = daemon.consistent()  # read once: the version scored is the one reported
    view = pair.dense
    weights = _served_weights(view)
    if weights is None:
        return out
    ho = _stream(StreamConfig(**cfg["stream"])).batch(int(msg["start"]), int(msg["n"]),
                                                       salt=1)
    zeros = RowTable(np.empty(0, np.int64), np.empty((0, cfg["dim"]), np.float32))
    tables = daemon.tables()  # the live tables: lookups are lock-free
    logits = score(weights, (tables.get("user") or zeros).lookup,
                   (tables.get("item") or zeros).lookup, ho.user_ids, ho.item_ids, ho.dense)
    out.update(auc=auc(ho.labels, logits), dense_step=int(view.step),
               dense_age_steps=pair.ahead_steps, dense_age_s=max(0.0, now - view.ts / 1e9))
    return out


def _drain(daemon: SyncDaemon, finish: dict, start_offsets: dict) -> None:
    """Wait until ``daemon`` applied everything up to the trainers' final offsets
    (``finish["offsets"]``, within ``finish["timeout"]`` s; TimeoutError otherwise)."""
    target = {int(p): int(o) for p, o in finish["offsets"].items()}
    deadline = time.monotonic() + float(finish.get("timeout", 60.0))
    while True:
        pos = daemon.stats()["positions"]
        if all(pos.get(p, start_offsets.get(p, 0)) >= o for p, o in target.items()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"predictor did not reach the final offsets {target} within "
                               f"{finish.get('timeout', 60.0)} s (at {pos})")
        time.sleep(0.05)


def _predictor(cfg: dict, events: Any, control: Any) -> None:
    torch_at_start = "torch" in sys.modules
    state = Path(cfg["state_dir"])
    work = Path(cfg["work_dir"])
    kafka_config = cfg.get("kafka_config") or {}
    start_offsets = write_start_base(work / "predictor-base", cfg["bootstrap_servers"],
                                     cfg["topic"], kafka_config)
    alog = ApplyLog()
    daemon = SyncDaemon(cfg["bootstrap_servers"], cfg["topic"], model=cfg["model_name"],
                        state_dir=state, base=work / "predictor-base", on_apply=alog,
                        checkpoint_interval=cfg.get("checkpoint_interval", 5.0),
                        summary_interval=0, freshness_window=30.0, poll_timeout_ms=100,
                        **kafka_config)
    runner = threading.Thread(target=daemon.run, name="sync-daemon", daemon=True)
    runner.start()
    events.put({"kind": "ready", "who": "predictor", "start_offsets": start_offsets})
    interval = float(cfg.get("progress_interval", 0.5))
    finish: Optional[dict] = None
    while finish is None:
        try:
            msg = control.get(timeout=interval)
        except queue.Empty:
            msg = None
        if msg is not None:
            if msg.get("kind") == "finish":
                finish = msg
            elif msg.get("kind") == "abort":
                daemon.stop()
                return
            elif msg.get("kind") == "eval":
                events.put(serving_eval(msg, daemon, cfg))
        st = daemon.stats()
        events.put({"kind": "serve", "t": time.time(), "lag": st["lag_total"],
                    "messages": st["messages"], "rows": st["rows"],
                    "fresh_p50": st["freshness_p50_s"], "fresh_p99": st["freshness_p99_s"],
                    "broker": st["broker"]})
        if not runner.is_alive():
            raise RuntimeError("the sync daemon thread stopped unexpectedly")

    _drain(daemon, finish, start_offsets)
    daemon.stop()
    runner.join(timeout=30)
    st = daemon.stats()
    t_apply, fresh, rows = alog.arrays()

    # ---- scoring and drift (numpy only)
    cfg = dict(cfg, **finish.get("cfg", {}))
    weights, trainer, published, torch_scores = _load_trainer(finish["dumps"], cfg["dim"])
    serving = daemon.tables()
    drift = _drift(serving, trainer, published, cfg["wire_dtype"])
    # served: the newest complete dense version the daemon assembled from the stream
    served = daemon.dense()
    aucs = _score_all(cfg, weights, serving, trainer, torch_scores, _served_weights(served))
    aucs.update(dense_version=st["dense_version"], dense_age_s=st["dense_age_s"],
                dense_age_steps=st["dense_age_steps"])
    boot = _bootstrap_check(cfg, trainer, serving, served) if cfg.get("bootstrap_check", True) \
        else {"skipped": "disabled"}
    result = {
        "kind": "result", "who": "predictor",
        "stats": {k: st[k] for k in ("messages", "applied", "rows", "deleted", "bytes",
                                     "duplicates", "gaps", "quarantined", "offsets_lost",
                                     "checkpoints", "new_epochs", "stale", "tables",
                                     "dense_versions", "dense_incomplete", "dense_unbased",
                                     "dense_gaps")},
        "freshness": _quantiles(fresh),
        "apply_t": (t_apply - float(cfg["t0"])).tolist(),
        "apply_fresh": fresh.tolist(),
        "apply_rows": rows.tolist(),
        "drift": drift,
        "auc": aucs,
        "bootstrap": boot,
        "torch_imported": bool(torch_at_start or "torch" in sys.modules),
    }
    events.put(result)
