"""A bounded JSON-lines file of records that could not be applied.

Each :meth:`Quarantine.add` appends one line::

    {"partition": 0, "offset": 17, "reason": "decode: crc: CRC-32C mismatch ...",
     "size": 4711, "first_bytes_hex": "de0010a176...", "time": 1718000000.123}

``first_bytes_hex`` holds the first 64 bytes of the record (enough to recognise a foreign
producer or a truncated message); the record itself stays in Kafka at (partition, offset)
until retention removes it.

Bound: when a line would take ``path`` past ``max_bytes``, ``path`` is renamed to ``path.1``
(replacing an older ``path.1``) and a fresh ``path`` is started, so the two files together
never hold more than 2 × ``max_bytes`` and the newest records are always kept. Older lines
are dropped on the second rotation; :attr:`count` and :attr:`rotations` keep counting.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Union

__all__ = ["Quarantine", "FIRST_BYTES"]

log = logging.getLogger(__name__)

FIRST_BYTES = 64
_MAX_REASON = 2000  # chars; a reason quoting a huge value must not blow the line up


class Quarantine:
    """Append-only, size-bounded quarantine log (thread-safe).

    Args:
        path: the JSON-lines file (parent directories are created).
        max_bytes: bound of one file in bytes (≥ 1024); see the module docstring.
    """

    def __init__(self, path: Union[str, os.PathLike], max_bytes: int = 64 << 20):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1024:
            raise ValueError(f"max_bytes: expected an int ≥ 1024, got {max_bytes!r}")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.count = 0  #: records added by this instance
        self.rotations = 0  #: times path was moved to path.1
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, partition: int, offset: int, reason: str, value: Any) -> None:
        """Record that the message at (partition, offset) was quarantined for ``reason``."""
        try:
            raw = bytes(memoryview(value)[:FIRST_BYTES]) if value is not None else b""
            size = len(memoryview(value).cast("B")) if value is not None else 0
        except TypeError:
            raw, size = repr(value)[:FIRST_BYTES].encode(), 0
        reason = str(reason)
        if len(reason) > _MAX_REASON:
            reason = reason[:_MAX_REASON] + "…"
        line = json.dumps({"partition": partition, "offset": offset, "reason": reason,
                           "size": size, "first_bytes_hex": raw.hex(),
                           "time": round(time.time(), 6)}, ensure_ascii=False) + "\n"
        data = line.encode()
        with self._lock:
            try:
                current = self.path.stat().st_size
            except FileNotFoundError:
                current = 0
            if current and current + len(data) > self.max_bytes:
                os.replace(self.path, self.path.with_name(self.path.name + ".1"))
                self.rotations += 1
                log.info("quarantine file %s reached %d bytes; rotated to %s.1", self.path,
                         current, self.path.name)
            with open(self.path, "ab") as f:
                f.write(data)
            self.count += 1

    def read(self) -> list[dict]:
        """All records still on disk, oldest first (``path.1`` then ``path``)."""
        out = []
        for p in (self.path.with_name(self.path.name + ".1"), self.path):
            try:
                text = p.read_text(encoding="utf-8")
            except FileNotFoundError:
                continue
            out.extend(json.loads(ln) for ln in text.splitlines() if ln.strip())
        return out
