"""deltastream.cores: the cores torch's threads leave spare, local ranks counted."""

from __future__ import annotations

import os

import pytest
import torch

from deltastream.cores import process_cores, spare_cores


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_process_cores_is_the_affinity_mask():
    assert process_cores() == len(os.sched_getaffinity(0))


def test_spare_cores_counts_the_threads_of_every_local_rank(threads, monkeypatch):
    n = process_cores()
    threads(1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert spare_cores() == n - 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(n))  # torchrun: n ranks of one thread
    assert spare_cores() == 0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")  # ignored, as one rank
    assert spare_cores() == n - 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    threads(n + 3)  # more threads than cores: none spare, never negative
    assert spare_cores() == 0
