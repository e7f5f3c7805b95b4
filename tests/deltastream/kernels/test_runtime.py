"""The kernel-or-reference rule of deltastream.kernels.runtime."""

from __future__ import annotations

import pytest
import torch

from deltastream.kernels import runtime
from deltastream.kernels.runtime import current_mode, kernels_mode, use_kernels


def test_off_never_uses_kernels():
    with kernels_mode("off"):
        assert not use_kernels(torch.zeros(1))


def test_auto_leaves_cpu_tensors_on_the_reference_path():
    with kernels_mode("auto"):
        assert not use_kernels(torch.zeros(1))


def test_on_uses_kernels_on_cpu_only_under_the_interpreter():
    with kernels_mode("on"):
        assert use_kernels(torch.zeros(1)) == (runtime.interpreted()
                                               and runtime.triton_available())


def test_modes_nest_and_restore():
    outer = current_mode()
    with kernels_mode("on"):
        with kernels_mode("off"):
            assert current_mode() == "off"
        assert current_mode() == "on"
    assert current_mode() == outer


def test_bad_mode_is_named():
    with pytest.raises(ValueError, match="got 'fast'"):
        with kernels_mode("fast"):
            pass


def test_bad_env_mode_is_named(monkeypatch):
    monkeypatch.setenv("DELTASTREAM_KERNELS", "maybe")
    try:
        with pytest.raises(ValueError, match="DELTASTREAM_KERNELS.*'maybe'"):
            runtime.reload_env()
    finally:
        monkeypatch.delenv("DELTASTREAM_KERNELS")
        runtime.reload_env()


def test_env_aliases(monkeypatch):
    try:
        monkeypatch.setenv("DELTASTREAM_KERNELS", "0")
        assert runtime.reload_env() == "off" == current_mode()
        monkeypatch.setenv("DELTASTREAM_KERNELS", "1")
        assert runtime.reload_env() == "on" == current_mode()
    finally:
        monkeypatch.delenv("DELTASTREAM_KERNELS")
        runtime.reload_env()


def test_kernel_device_fixture_runs_kernels(kernel_device):
    assert use_kernels(torch.zeros(1, device=kernel_device))
