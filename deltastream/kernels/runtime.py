"""When deltastream's Triton kernels run instead of the torch reference path.

Every kernel has a torch reference implementation with the same contract; the kernels are
the fast path on CUDA. Which one runs is decided per call by :func:`use_kernels`:

=================  ==========================  ====================================
mode               CUDA tensor                 CPU tensor
=================  ==========================  ====================================
``auto`` (default) kernels if Triton imports   torch reference
``on``             kernels (error if no Triton) kernels under Triton's interpreter
                                               only (``TRITON_INTERPRET=1``), else
                                               the torch reference
``off``            torch reference             torch reference
=================  ==========================  ====================================

The mode comes from ``DELTASTREAM_KERNELS`` (``auto``/``on``/``off``, also ``1``/``0``; read
once, at first use, or again by :func:`reload_env`), or :func:`kernels_mode` (a context
manager, for tests and benchmarks). Triton's
interpreter must be chosen before ``triton`` is first imported: that is how CI, which has
no GPU, runs every kernel on CPU tensors against the reference (small sizes: it is slow).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator

import torch

__all__ = ["triton_available", "interpreted", "use_kernels", "kernels_mode", "current_mode",
           "reload_env", "MODES"]

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
_ALIASES = {"1": "on", "0": "off", "true": "on", "false": "off", "": "auto"}
_override: list[str] = []  # innermost kernels_mode() last
_env: list[str] = []  # DELTASTREAM_KERNELS, parsed once: use_kernels runs on every table op


def reload_env() -> str:
    """Read ``DELTASTREAM_KERNELS`` again; returns the mode it names, or ``ValueError``."""
    raw = os.environ.get("DELTASTREAM_KERNELS", "auto").strip().lower()
    mode = _ALIASES.get(raw, raw)
    if mode not in MODES:
        raise ValueError(f"DELTASTREAM_KERNELS: expected one of auto, on, off (or 1, 0), "
                         f"got {raw!r}")
    _env[:] = [mode]
    return mode


def current_mode() -> str:
    """The mode in force: the innermost :func:`kernels_mode`, else ``DELTASTREAM_KERNELS``."""
    if _override:
        return _override[-1]
    return _env[0] if _env else reload_env()


@functools.cache
def triton_available() -> bool:
    """True when ``triton`` imports (it ships with CUDA builds of torch)."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken install: the reference path works
        log.debug("triton unavailable: %s", e)
        return False
    return True


def interpreted() -> bool:
    """True when Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def use_kernels(t: torch.Tensor) -> bool:
    """Whether an operation on tensor ``t`` should take the Triton kernel path."""
    mode = current_mode()
    if mode == "off":
        return False
    if t.is_cuda:
        if mode == "on" and not triton_available():
            raise RuntimeError("DELTASTREAM_KERNELS=on but triton does not import")
        return triton_available()
    return mode == "on" and interpreted() and triton_available()


@contextlib.contextmanager
def kernels_mode(mode: str) -> Iterator[None]:
    """Run the body with kernel mode ``mode`` (``auto``, ``on`` or ``off``)."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
    _override.append(mode)
    try:
        yield
    finally:
        _override.pop()
