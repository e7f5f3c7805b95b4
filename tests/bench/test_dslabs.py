"""The second public log's reader: R's serialization and lazy-load database (bench._rdata),
the .deb around them and the ratings read out of it (bench._dslabs), and --dataset in
bench._ratings — on a tiny package written here the way R and dpkg write theirs (no copy
of the real data)."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import struct
import tarfile
import zlib

import numpy as np
import pytest

from bench import _dslabs, _ratings, _rdata

# ---------------------------------------------------------------- an R serialization writer

_ATTR, _TAG = 1 << 9, 1 << 10


def _i(v: int) -> bytes:
    return struct.pack(">i", v)


def _char(s: str | None) -> bytes:
    if s is None:
        return _i(9) + _i(-1)
    b = s.encode()
    return _i(9 | (1 << 15)) + _i(len(b)) + b  # gp bit: UTF-8


def _attrs(pairs: list[tuple[str, bytes]]) -> bytes:
    """A pairlist of tagged values (symbols written afresh each time: REFSXP not needed)."""
    out = b""
    for tag, value in pairs:
        out += _i(2 | _TAG) + _i(1) + _char(tag) + value
    return out + _i(254)


def _vec(kind: int, body: bytes, n: int, attrs: list | None = None) -> bytes:
    return _i(kind | (_ATTR if attrs else 0)) + _i(n) + body + (_attrs(attrs) if attrs else b"")


def _ints(v, attrs=None) -> bytes:
    return _vec(13, struct.pack(f">{len(v)}i", *v), len(v), attrs)


def _reals(v, attrs=None) -> bytes:
    return _vec(14, struct.pack(f">{len(v)}d", *v), len(v), attrs)


def _strs(v, attrs=None) -> bytes:
    return _vec(16, b"".join(_char(s) for s in v), len(v), attrs)


def _list(items: list[bytes], attrs=None) -> bytes:
    return _vec(19, b"".join(items), len(items), attrs)


def _serialize(obj: bytes, version: int = 3) -> bytes:
    head = b"X\n" + _i(version) + _i(0x040201) + _i(0x030500)
    return head + (_i(5) + b"UTF-8" if version == 3 else b"") + obj


def _frame(cols: dict[str, bytes], n: int) -> bytes:
    # row.names as R stores a compact one: c(NA_integer_, -n)
    return _list(list(cols.values()), [("names", _strs(list(cols))),
                                       ("class", _strs(["data.frame"])),
                                       ("row.names", _ints([_rdata.NA_INTEGER, -n]))])


def _lazyload(objects: dict[str, bytes], kind: bytes = b"") -> tuple[bytes, bytes]:
    """(Rdata.rdx, Rdata.rdb) holding ``objects`` (serialized), as R's makeLazyLoadDB:
    zlib (``kind`` empty, R's default) or a type byte: ``X`` xz, ``2`` bzip2, ``0`` none."""
    pack = {b"": zlib.compress, b"X": lzma.compress, b"2": bz2.compress, b"0": bytes}[kind]
    rdb, where = b"", {}
    for name, ser in objects.items():
        blob = struct.pack(">I", len(ser)) + kind + pack(ser)
        where[name] = (len(rdb), len(blob))
        rdb += blob
    variables = _list([_ints(list(v)) for v in where.values()], [("names", _strs(list(where)))])
    index = _list([variables, _list([]), _reals([1.0])],
                  [("names", _strs(["variables", "references", "compressed"]))])
    return gzip.compress(_serialize(index)), rdb


def _deb(files: dict[str, bytes]) -> bytes:
    """A .deb: an ar archive of debian-binary, control.tar.xz and data.tar.xz."""
    def tar(members: dict[str, bytes]) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:xz") as t:
            for name, data in members.items():
                info = tarfile.TarInfo("./" + name)
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
        return buf.getvalue()

    out = b"!<arch>\n"
    for name, data in (("debian-binary", b"2.0\n"), ("control.tar.xz", tar({"control": b""})),
                       ("data.tar.xz", tar(files))):
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}`\n".encode() + data
        out += b"\n" if len(data) % 2 else b""
    return out


# rows out of time order, ids not dense, half stars, a factor column, a string column
USERS, MOVIES = [7, 3, 7, 9], [31, 1029, 1029, 5]
RATINGS, TS = [2.5, 4.0, 5.0, 0.5], [300, 100, 200, 400]


def _movielens(**override) -> bytes:
    cols = {"movieId": _ints(MOVIES), "title": _strs(["a", "b", "b", None]),
            "genres": _ints([1, 2, 2, 1], [("levels", _strs(["Drama", "Comedy"])),
                                           ("class", _strs(["factor"]))]),
            "userId": _ints(USERS), "rating": _reals(RATINGS), "timestamp": _ints(TS)}
    cols.update(override)
    return _serialize(_frame(cols, len(USERS)))


def _write_package(path, frame: bytes) -> None:
    rdx, rdb = _lazyload({"murders": _serialize(_ints([1])), "movielens": frame})
    path.write_bytes(_deb({f"{_dslabs.DATA_DIR}/Rdata.rdx": rdx,
                           f"{_dslabs.DATA_DIR}/Rdata.rdb": rdb}))


# ---------------------------------------------------------------------------------- tests

def test_a_data_frame_is_read_back_column_by_column():
    cols = _rdata.data_frame_columns(_rdata.unserialize(_movielens()))
    assert cols["userId"].tolist() == USERS and cols["rating"].tolist() == RATINGS
    assert cols["genres"] == ["Drama", "Comedy", "Comedy", "Drama"]
    assert cols["title"] == ["a", "b", "b", None]
    with pytest.raises(ValueError, match="not an R data frame"):
        _rdata.data_frame_columns(_rdata.unserialize(_serialize(_ints([1]))))


@pytest.mark.parametrize("kind", [b"", b"X", b"2", b"0"])
def test_each_lazy_load_compression_is_read(kind):
    rdx, rdb = _lazyload({"x": _serialize(_ints([1])), "movielens": _movielens()}, kind)
    frame = _rdata.lazyload_object(rdx, rdb, "movielens")
    assert _rdata.data_frame_columns(frame)["timestamp"].tolist() == TS


def test_unsupported_input_is_refused_by_name():
    with pytest.raises(ValueError, match="not an R XDR"):
        _rdata.unserialize(b"RDX2\n")
    with pytest.raises(ValueError, match="type 3 "):  # a closure
        _rdata.unserialize(_serialize(_i(3)))
    rdx, rdb = _lazyload({"movielens": _movielens()})
    with pytest.raises(KeyError, match="movielens"):
        _rdata.lazyload_object(rdx, rdb, "ratings")
    with pytest.raises(ValueError, match="truncated"):
        _rdata.lazyload_object(rdx, rdb[:-3], "movielens")


def test_the_ratings_of_a_package_are_read_from_its_deb(tmp_path):
    deb = tmp_path / "r-cran-dslabs_0.1-1_all.deb"
    _write_package(deb, _movielens())
    users, items, ratings, ts = _dslabs.ratings_from_deb(deb)
    assert users.tolist() == USERS and items.tolist() == MOVIES and ts.tolist() == TS
    assert ratings.dtype == np.float32 and ratings.tolist() == RATINGS


def test_a_missing_value_or_column_is_an_error_not_a_rating(tmp_path):
    deb = tmp_path / "r-cran-dslabs_0.1-1_all.deb"
    _write_package(deb, _movielens(timestamp=_ints([300, _rdata.NA_INTEGER, 200, 400])))
    with pytest.raises(ValueError, match="1 ratings have a missing .* row 2"):
        _dslabs.ratings_from_deb(deb)
    _write_package(deb, _serialize(_frame({"userId": _ints(USERS)}, len(USERS))))
    with pytest.raises(ValueError, match="expected"):
        _dslabs.ratings_from_deb(deb)
    other = tmp_path / "other.deb"
    other.write_bytes(_deb({"usr/share/doc/x": b"x"}))
    with pytest.raises(ValueError, match="has no .*Rdata"):
        _dslabs.ratings_from_deb(other)


def test_dataset_ml_latest_small_reads_the_cached_deb_in_time_order(tmp_path):
    _write_package(tmp_path / "r-cran-dslabs_0.1-1_all.deb", _movielens())
    r = _ratings.load_ratings(None, None, tmp_path, fetch=False, dataset="ml-latest-small")
    assert r.ts.tolist() == sorted(TS) and "r-cran-dslabs_0.1-1_all.deb" in r.source
    # time order: (3, 1029), (7, 1029), (7, 31), (9, 5); dense ids in id order
    assert r.users.tolist() == [0, 1, 1, 2] and r.items.tolist() == [2, 2, 1, 0]
    again = _ratings.load_ratings(None, None, tmp_path, fetch=False, dataset="ml-latest-small")
    assert np.array_equal(again.items, r.items) and len(list(tmp_path.glob("*.npz"))) == 1
    with pytest.raises(ValueError, match="unknown dataset"):
        _ratings.load_ratings(None, None, tmp_path, dataset="ml-1m")


def test_without_the_deb_and_no_fetch_it_says_how_to_get_it(tmp_path):
    with pytest.raises(_ratings.LogUnavailable, match="apt-get download r-cran-dslabs"):
        _ratings.load_ratings(None, None, tmp_path, fetch=False, dataset="ml-latest-small")


def test_a_failed_fetch_fails_loudly_with_the_command(tmp_path, monkeypatch):
    """No .deb in the cache and apt-get cannot fetch one (a real apt-get run for a package
    that does not exist): the bench exits non-zero with apt-get's reason and the command
    that gets the log — it never passes having measured nothing."""
    from bench import freshness_per_byte as bench

    monkeypatch.setattr(_dslabs, "DEB_PACKAGE", "deltastream-no-such-package")
    with pytest.raises(SystemExit) as e:
        bench.main(["--dataset", "ml-latest-small", "--cache", str(tmp_path)])
    text = str(e.value.code)
    assert "error" in text and "deltastream-no-such-package" in text
    assert "apt-get download r-cran-dslabs" in text
    with pytest.raises(SystemExit):  # a named log and a file: which one?
        bench.main(["--dataset", "ml-latest-small", "--log", str(tmp_path / "x")])
