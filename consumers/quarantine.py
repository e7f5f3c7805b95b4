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

Idempotent across restarts: a daemon killed after quarantining records but before its next
checkpoint re-reads those records when it restarts. On opening, the tail of both files is
read to find the highest quarantined offset per partition; a record at or below it is not
appended again (:attr:`duplicates`). :meth:`forget` drops a partition's mark when its log
was replaced (offsets start over).

Write failures (a full or read-only disk) never raise: the line is kept in memory
(:attr:`backlog`, bounded) and retried by the next :meth:`add` or :meth:`flush`;
:attr:`write_errors` counts failed attempts and :attr:`last_error` holds the last one. The
sync daemon checkpoints only after :meth:`flush` returned True, so a checkpoint's offsets
never pass a record whose quarantine line is not on disk: after a restart, such a record is
read and quarantined again. A backlog over ``backlog_max`` lines drops the newest ones
(:attr:`dropped`); :meth:`flush` then stays False for the life of this object (the records
are re-read after a restart).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Optional, Union

from consumers.files import no_follow

__all__ = ["Quarantine", "FIRST_BYTES"]

log = logging.getLogger(__name__)

FIRST_BYTES = 64
_MAX_REASON = 2000  # chars; a reason quoting a huge value must not blow the line up
_TAIL_BYTES = 4 << 20  # bytes of each file read on open to find the quarantined offsets


class Quarantine:
    """Append-only, size-bounded quarantine log (thread-safe).

    Args:
        path: the JSON-lines file (parent directories are created when possible).
        max_bytes: bound of one file in bytes (≥ 1024); see the module docstring.
        backlog_max: lines kept in memory while the disk refuses writes (≥ 1).
    """

    def __init__(self, path: Union[str, os.PathLike], max_bytes: int = 64 << 20, *,
                 backlog_max: int = 10_000):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1024:
            raise ValueError(f"max_bytes: expected an int ≥ 1024, got {max_bytes!r}")
        if isinstance(backlog_max, bool) or not isinstance(backlog_max, int) \
                or backlog_max < 1:
            raise ValueError(f"backlog_max: expected an int ≥ 1, got {backlog_max!r}")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backlog_max = backlog_max
        self.count = 0  #: lines written by this instance
        self.rotations = 0  #: times path was moved to path.1
        self.duplicates = 0  #: records not appended again (already in the file)
        self.write_errors = 0  #: failed write attempts
        self.dropped = 0  #: lines lost because the backlog was full
        self.last_error: Optional[OSError] = None  #: the last write failure
        self._lock = threading.Lock()
        self._backlog: list[tuple[int, int, bytes]] = []  # (partition, offset, line)
        self._unsynced = False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a read-only disk: counted when a line must be written
            log.warning("quarantine directory %s cannot be created: %s", self.path.parent, e)
        self._torn: Optional[bool]  # path ends in a torn line (None: unknown, look)
        self._marks, self._torn = self._scan()

    # ------------------------------------------------------------------ reading

    def _rotated(self) -> Path:
        return self.path.with_name(self.path.name + ".1")

    def _scan(self) -> tuple[dict[int, int], bool]:
        """(highest offset per partition in the tails of both files, whether ``path``
        ends in a torn line)."""
        marks: dict[int, int] = {}
        torn = False
        for p in (self._rotated(), self.path):
            try:
                with open(p, "rb") as f:
                    size = f.seek(0, os.SEEK_END)
                    start = max(0, size - _TAIL_BYTES)
                    f.seek(start)
                    data = f.read()
            except FileNotFoundError:
                continue
            except OSError as e:
                log.warning("quarantine file %s cannot be read (%s); records quarantined "
                            "before a crash may be listed twice", p, e)
                continue
            if p == self.path:
                torn = bool(data) and not data.endswith(b"\n")
            lines = data.split(b"\n")
            if start > 0:
                lines = lines[1:]  # the first line of the tail is cut
            for ln in lines:
                try:
                    rec = json.loads(ln)
                    part, off = rec["partition"], rec["offset"]
                except (ValueError, TypeError, KeyError):
                    continue  # a torn line (crash mid-write) or not ours
                if isinstance(part, int) and isinstance(off, int):
                    marks[part] = max(off, marks.get(part, -1))
        return marks, torn

    def quarantined_up_to(self, partition: int) -> Optional[int]:
        """Highest offset of ``partition`` found quarantined in the files on opening."""
        return self._marks.get(partition)

    def read(self) -> list[dict]:
        """All records still on disk, oldest first (``path.1`` then ``path``); torn lines
        (a crash mid-write) are left out."""
        out = []
        for p in (self._rotated(), self.path):
            try:
                text = p.read_text(encoding="utf-8", errors="replace")
            except FileNotFoundError:
                continue
            for ln in text.splitlines():
                try:
                    out.append(json.loads(ln))
                except ValueError:
                    continue
        return out

    # ------------------------------------------------------------------ writing

    @property
    def backlog(self) -> int:
        """Lines waiting in memory because writing them failed."""
        return len(self._backlog)

    def forget(self, partition: int) -> None:
        """The log of ``partition`` was replaced (offsets start over): stop skipping its
        offsets found on opening."""
        with self._lock:
            self._marks.pop(partition, None)

    def add(self, partition: int, offset: int, reason: str, value: Any) -> bool:
        """Record that the message at (partition, offset) was quarantined for ``reason``.

        Returns True when every quarantined line is on disk now (False: kept in memory
        and retried, see the module docstring). Never raises on a write failure."""
        with self._lock:
            mark = self._marks.get(partition)
            if mark is not None and offset <= mark:
                self.duplicates += 1  # quarantined before a restart: already in the file
                return self._flush_locked()
            line = _line(partition, offset, reason, value)
            if len(self._backlog) >= self.backlog_max:
                self.dropped += 1
            else:
                self._backlog.append((partition, offset, line))
            return self._flush_locked()

    def flush(self, sync: bool = False) -> bool:
        """Write the lines kept in memory; with ``sync`` also fsync the file. True when
        every quarantined line is on disk (durably, with ``sync``)."""
        with self._lock:
            ok = self._flush_locked()
            if ok and sync and self._unsynced:
                try:
                    self._fsync(self.path)
                except OSError as e:
                    self._failed(e)
                    return False
                self._unsynced = False
            return ok

    def _flush_locked(self) -> bool:
        while self._backlog:
            _, _, data = self._backlog[0]
            try:
                self._write(data)
            except OSError as e:
                self._failed(e)
                return False
            self._backlog.pop(0)
            self.count += 1
        return self.dropped == 0

    def _failed(self, e: OSError) -> None:
        self.write_errors += 1
        self.last_error = e
        self._torn = None  # part of a line may have landed: look before the next write

    def _write(self, data: bytes) -> None:
        try:
            current = self.path.stat().st_size
        except FileNotFoundError:
            current = 0
        if current and current + len(data) > self.max_bytes:
            self._fsync(self.path)  # lines in the rotated file stay durable
            os.replace(self.path, self._rotated())
            self.rotations += 1
            self._torn = False
            log.info("quarantine file %s reached %d bytes; rotated to %s", self.path,
                     current, self._rotated().name)
        if self._torn is None:
            self._torn = self._ends_torn()
        with open(self.path, "ab", opener=no_follow) as f:  # never through a link
            # a line torn by a crash or a failed write must not swallow the next one
            f.write(b"\n" + data if self._torn else data)
        self._torn = False
        self._unsynced = True

    def _ends_torn(self) -> bool:
        try:
            with open(self.path, "rb", opener=no_follow) as f:
                if f.seek(0, os.SEEK_END) == 0:
                    return False
                f.seek(-1, os.SEEK_END)
                return f.read(1) != b"\n"
        except FileNotFoundError:
            return False

    @staticmethod
    def _fsync(path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _line(partition: int, offset: int, reason: str, value: Any) -> bytes:
    """One JSON line (bytes) for a quarantined record."""
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
    return line.encode()
