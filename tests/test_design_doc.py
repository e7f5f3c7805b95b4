"""docs/DESIGN.md stays true where a test can hold it: the wire tables match the encoder and
the architecture table lists the layout test's rooms in their order."""

from __future__ import annotations

import re
from pathlib import Path

import msgpack
import numpy as np

from deltastream import dense_wire, wire
from deltastream.wire_codec import DENSE_HEAD, FIELD_KEYS
from tests.test_layout import ROOMS

DOC = Path(__file__).resolve().parents[1] / "docs" / "DESIGN.md"


def _section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def _first_column(section: str) -> list[str]:
    """The backticked names of the first column of every table row in ``section``."""
    rows = [ln for ln in section.splitlines() if ln.startswith("| `")]
    return [re.findall(r"`([^`]+)`", ln.split("|")[1]) for ln in rows]


def _batch(**kw) -> wire.DeltaBatch:
    n, dim = 3, kw.pop("dim", 4)
    base = dict(model="m", table="t", shard=1, epoch=7, seq=2, step=5, ts=123,
                ids=np.array([1, 5, 9]), rows=np.arange(n * dim, dtype=np.float32).reshape(n, dim),
                dtype="f32")
    base.update(kw)
    return wire.DeltaBatch(**base)


def test_the_wire_table_lists_exactly_the_encoders_keys_in_order():
    documented = [re.findall(r"`([^`]+)`", ln.split("|")[1])[0]
                  for ln in _section("Wire format").splitlines()
                  if ln.startswith("| `") and ln.split("|")[2].strip() in ("int", "str", "bin")]
    plain = _batch()
    full = _batch(dtype="i8", tombstones=np.array([4, 6]), col=4, width=12)
    residual = _batch(dtype="r1", tombstones=np.array([4]), fresh=np.array([True, False, True]))
    compact = _batch(dtype="r1e", fresh=np.array([True, False, True]))
    names = {k: name for name, k in FIELD_KEYS.items()}
    seen: set = set()
    for b, version in ((plain, 2), (full, 2), (plain, 3), (full, 3), (residual, 4),
                       (compact, 5)):
        (msg,) = wire.encode(b, version=version)
        assert msg[0] == 0xde  # map16
        if version < 4:
            assert msg[-9:-4] == b"\xa3crc\xce"  # the 9-byte CRC trailer
        keys = [names.get(k, k) for k in msgpack.unpackb(msg, raw=False, strict_map_key=False)]
        assert keys == [k for k in documented if k in keys], (keys, documented)
        seen |= set(keys)
    assert {"idv", "fresh"} <= seen and set(documented) == seen


def test_the_architecture_table_lists_the_layout_rooms_in_order():
    tops = {r for r in ROOMS if "." not in r}
    names: list[str] = []
    for cell in _first_column(_section("Architecture")):
        prefix = ""
        for token in cell:
            if "." in token:
                prefix = token.rsplit(".", 1)[0] + "."
                names.append(token)
            else:
                names.append(token if token in tops else prefix + token)
    assert names == list(ROOMS)


def test_the_dense_wire_table_lists_exactly_the_encoders_keys_in_order():
    documented = [re.findall(r"`([^`]+)`", ln.split("|")[1])[0]
                  for ln in _section("Wire kind dense").splitlines()
                  if ln.startswith("| `")
                  and ln.split("|")[2].strip() in ("int", "str", "bin", "bool")]
    (chunk,) = dense_wire.chunk_version({"w": np.ones((2, 3), np.float32)}, model="m", shard=0,
                                        epoch=1, seq=0, step=4, ts=5)
    (msg,) = dense_wire.encode_dense([chunk])
    assert msg[:3] == b"\xde" + len(documented).to_bytes(2, "big")  # map16, its count
    assert msg[3:3 + len(DENSE_HEAD)] == DENSE_HEAD  # the head the row decoder refuses
    assert msg[-9:-4] == b"\xa3crc\xce"
    assert list(msgpack.unpackb(msg, raw=False).keys()) == documented
