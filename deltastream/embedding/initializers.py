"""Row initializers of :class:`~deltastream.embedding.hashtable.HashTable`.

An initializer is called as ``init(n, dim, *, device, dtype) -> [n, dim]`` for the rows of
newly inserted ids (``ids=`` too when it accepts it). Its ``eval_value`` is what unseen ids
read as in eval mode and through ``HashTable.lookup``: :func:`normal_initializer` reads as
its mean, :func:`constant_initializer` as its constant, :func:`uniform_initializer` (and a
plain callable without ``eval_value``) as 0. A seeded initializer owns one generator per
device, so a table's rows are reproducible.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Optional

import torch

__all__ = [
    "Initializer",
    "normal_initializer",
    "uniform_initializer",
    "constant_initializer",
    "accepted_kwargs",
    "init_rows",
]


class Initializer:
    """Base class of the row initializers: ``init(n, dim, *, device, dtype) -> [n, dim]``.

    ``eval_value`` is the value unseen ids read as in eval mode / :meth:`HashTable.lookup`.
    A seeded initializer owns one generator per device, so a table's rows are reproducible.
    """

    eval_value: float = 0.0

    def __init__(self, seed: Optional[int] = None) -> None:
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, device: torch.device) -> Optional[torch.Generator]:
        if self.seed is None:
            return None
        key = str(device)
        gen = self._generators.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._generators[key] = gen
        return gen

    def __call__(self, n: int, dim: int, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError


class _Normal(Initializer):
    def __init__(self, std: float, mean: float, seed: Optional[int]) -> None:
        super().__init__(seed)
        self.std, self.mean = float(std), float(mean)
        self.eval_value = self.mean

    def __call__(self, n, dim, *, device="cpu", dtype=torch.float32):
        device = torch.device(device)
        out = torch.empty(n, dim, device=device, dtype=torch.float32)
        out.normal_(self.mean, self.std, generator=self._generator(device))
        return out.to(dtype)

    def __repr__(self) -> str:
        return f"normal_initializer(std={self.std}, mean={self.mean}, seed={self.seed})"


class _Uniform(Initializer):
    def __init__(self, a: float, seed: Optional[int]) -> None:
        super().__init__(seed)
        self.a = float(a)

    def __call__(self, n, dim, *, device="cpu", dtype=torch.float32):
        device = torch.device(device)
        out = torch.empty(n, dim, device=device, dtype=torch.float32)
        out.uniform_(-self.a, self.a, generator=self._generator(device))
        return out.to(dtype)

    def __repr__(self) -> str:
        return f"uniform_initializer(a={self.a}, seed={self.seed})"


class _Constant(Initializer):
    def __init__(self, value: float) -> None:
        super().__init__(None)
        self.value = float(value)
        self.eval_value = self.value

    def __call__(self, n, dim, *, device="cpu", dtype=torch.float32):
        return torch.full((n, dim), self.value, device=device, dtype=dtype)

    def __repr__(self) -> str:
        return f"constant_initializer({self.value})"


def normal_initializer(std: float = 0.01, mean: float = 0.0, *,
                       seed: Optional[int] = None) -> Initializer:
    """Rows drawn from N(mean, std²); unseen ids read as ``mean`` in eval mode."""
    if not std >= 0:
        raise ValueError(f"std must be >= 0, got {std}")
    return _Normal(std, mean, seed)


def uniform_initializer(a: float = 0.01, *, seed: Optional[int] = None) -> Initializer:
    """Rows drawn from U(-a, a); unseen ids read as 0 in eval mode."""
    if not a >= 0:
        raise ValueError(f"a must be >= 0, got {a}")
    return _Uniform(a, seed)


def constant_initializer(value: float = 0.0) -> Initializer:
    """Every new row is ``value``; unseen ids read as ``value`` in eval mode too."""
    return _Constant(value)


def accepted_kwargs(fn: Optional[Callable], names: tuple[str, ...]) -> frozenset:
    """Which of ``names`` ``fn`` accepts as keyword arguments."""
    if fn is None:
        return frozenset()
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return frozenset(names)
    ok = {p.name for p in params
          if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)}
    return frozenset(n for n in names if n in ok)


def init_rows(initializer: Optional[Callable[..., torch.Tensor]], accepted: frozenset,
              ids: torch.Tensor, dim: int, *, device: torch.device, dtype: torch.dtype,
              table: str) -> torch.Tensor:
    """Rows ``[len(ids), dim]`` on ``device`` in ``dtype`` for the newly inserted ``ids``.

    Calls ``initializer(n, dim, **kw)`` with those of ``device``, ``dtype`` and ``ids`` that
    it accepts (``accepted``, from :func:`accepted_kwargs`); zeros when it is None. Raises
    ``ValueError`` naming ``table`` when it returns anything but a ``[n, dim]`` tensor.
    """
    n = ids.numel()
    if initializer is None:
        return torch.zeros(n, dim, dtype=dtype, device=device)
    kw = {}
    if "device" in accepted:
        kw["device"] = device
    if "dtype" in accepted:
        kw["dtype"] = dtype
    if "ids" in accepted:
        kw["ids"] = ids
    rows = initializer(n, dim, **kw)
    if not isinstance(rows, torch.Tensor) or tuple(rows.shape) != (n, dim):
        got = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise ValueError(f"HashTable {table!r}: initializer returned {got}, expected "
                         f"a tensor of shape ({n}, {dim})")
    return rows.to(device=device, dtype=dtype)
