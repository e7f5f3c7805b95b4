"""Predictor persistence: atomic multi-table snapshots and incremental checkpoints.

Layered so that imports run one way (each module imports only those listed before it;
:mod:`consumers.serving_table` sits between ``table_stream`` and ``full_snapshot``):

* :mod:`~consumers.storage.files` — sealed manifests, verified reads, fsync, atomic
  directory swaps, the table directory layout (no knowledge of ServingTable);
* :mod:`~consumers.storage.table_stream` — a table directory written chunk by chunk from a
  frozen view (no second copy of a table in memory);
* :mod:`~consumers.storage.full_snapshot` — the full snapshot format (all tables in full);
* :mod:`~consumers.storage.checkpoint_dir` — what may stand at a checkpoint path (damage
  is refused), removing a checkpoint to start over;
* :mod:`~consumers.storage.checkpoint` — incremental checkpoints (a full base + segments);
* :mod:`~consumers.storage.background` — checkpoints written in a background thread;
* :mod:`~consumers.storage.snapshot` — ``write_snapshot`` / ``read_snapshot`` (reads every
  format above).
"""
