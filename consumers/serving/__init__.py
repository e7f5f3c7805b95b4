"""The serving table's one home: the table, its index, columns, storage dtypes, shared-memory
tables and their readers. Imports nothing of ``consumers.storage`` / ``sync`` / ``replay``
(they import this).

* :mod:`~consumers.serving.table` — :class:`~consumers.serving.table.ServingTable`, the
  public table (validation, apply, persistence surface);
* :mod:`~consumers.serving.dtypes` — the storage dtypes rows are kept in;
* :mod:`~consumers.serving.columns` — column slices of a wire batch (column-wise shards);
* :mod:`~consumers.serving.id_index` — the id -> slot hash index (two value copies per
  bucket, lock-free readers);
* :mod:`~consumers.serving.table_files` — a table's own directory (``save`` / ``load``
  and every table inside a snapshot);
* :mod:`~consumers.serving.memory` — reserved memory (private or a shared-memory file) and
  the header layout every table carries;
* :mod:`~consumers.serving.slots` — row slot allocation, reuse rules and change tracking;
* :mod:`~consumers.serving.growth` — incremental index migration (no apply pays for a
  whole rehash);
* :mod:`~consumers.serving.lookup` — the read path: probe the index and gather rows, in C
  (:mod:`consumers.serving.native`, built from ``native.c`` and ``native_loops.c`` at
  install when a compiler is there) or numpy;
* :mod:`~consumers.serving.accel` — whether that C code runs, for the read path and the
  writer's index work (the process-wide native/numpy switch);
* :mod:`~consumers.serving.core` — :class:`~consumers.serving.core.TableCore`, the
  single-writer / lock-free-reader table that :class:`~consumers.serving.table.ServingTable`
  wraps;
* :mod:`~consumers.serving.views` — frozen views of a table for checkpoints and exports;
* :mod:`~consumers.serving.shm` — the files of a shared table under ``/dev/shm`` (or
  another shm dir);
* :mod:`~consumers.serving.hugemap` — 2 MiB-aligned mappings of those files, and their
  blocks collapsed into huge pages; :mod:`~consumers.serving.backer` — their memory
  allocated and collapsed ahead of the writer, on a thread of its own; :mod:`~consumers.serving.mounts` — whether a tmpfs
  mount gives huge pages itself;
* :mod:`~consumers.serving.reader` — :class:`~consumers.serving.reader.TableReader`, the
  torch-free reader API for model-server processes (``TableReader.open(state_dir, name)``).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

log = logging.getLogger(__name__)

_EXPORTS = {"TableReader": "reader", "ReadInfo": "reader", "open_table": "reader",
            "ServingTable": "table", "ApplyResult": "table", "STORAGE_DTYPES": "dtypes"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'consumers.serving' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
