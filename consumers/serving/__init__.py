"""Serving internals: lock-free table storage, shared-memory tables and their readers.

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
  single-writer / lock-free-reader table that :class:`~consumers.serving_table.ServingTable`
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

_EXPORTS = {"TableReader": "reader", "ReadInfo": "reader", "open_table": "reader"}

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
