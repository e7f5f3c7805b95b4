"""The cores this process may run on, and how many of them torch's threads leave spare.

Two parts of deltastream only pay off on a core the training step does not use: the
tracker's lane thread (copies rows while a fused kernel runs) and the budget publisher's
worker process (rounds with no GIL shared with training). Both ask :func:`spare_cores`.
Ranks started by ``torchrun`` share a host's cores: its ``LOCAL_WORLD_SIZE`` processes
each run ``torch.get_num_threads()`` threads.
"""

from __future__ import annotations

import os

import torch

__all__ = ["process_cores", "spare_cores"]


def process_cores() -> int:
    """Cores in this process's affinity mask (``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _local_ranks() -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def spare_cores() -> int:
    """Cores of :func:`process_cores` that torch's threads (of every local rank) leave free;
    0 when none (never negative)."""
    return max(0, process_cores() - torch.get_num_threads() * _local_ranks())
