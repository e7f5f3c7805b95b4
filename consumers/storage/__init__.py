"""Predictor persistence: atomic multi-table snapshots and incremental checkpoints.

Stores serving tables, so it imports :mod:`consumers.serving` (the table, its directory
format :mod:`~consumers.serving.table_files`, its storage dtypes) and the durable-file
pieces of :mod:`consumers.files`; neither imports anything here. Inside, each module
imports only those listed before it:

* :mod:`~consumers.storage.full_format` — the full snapshot format (all tables in full);
* :mod:`~consumers.storage.merge` — several snapshots merged into one base;
* :mod:`~consumers.storage.checkpoint_dir` — what may stand at a checkpoint path (damage
  is refused), removing a checkpoint to start over;
* :mod:`~consumers.storage.segments` — a checkpoint segment file (rows changed after a
  base);
* :mod:`~consumers.storage.checkpoint_read` — reading an incremental checkpoint (its
  manifest, base, then segments in order);
* :mod:`~consumers.storage.checkpoint` — incremental checkpoints (a full base + segments);
* :mod:`~consumers.storage.background` — checkpoints written in a background thread;
* :mod:`~consumers.storage.snapshot` — ``write_snapshot`` / ``read_snapshot`` (reads every
  format above).
"""
