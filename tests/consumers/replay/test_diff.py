"""``deltastream-replay diff`` and the replay tool's argument parsing, on real snapshot files
(no broker)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from consumers.replay import (
    ReplayError,
    diff_snapshots,
    diff_tables,
    format_time,
    parse_offsets,
    parse_seq_range,
    parse_time,
)
from consumers.replay.cli import main
from consumers.serving.table import ServingTable, SnapshotError
from consumers.storage.snapshot import write_snapshot


def _table(name: str, ids, rows, dtype: str = "f32") -> ServingTable:
    return ServingTable.from_arrays(name, np.asarray(ids, np.int64),
                                    np.asarray(rows, np.float32), dtype=dtype)


@pytest.fixture
def pair(tmp_path):
    """Snapshots A and B with known differences."""
    rng = np.random.default_rng(3)
    ids = np.arange(0, 2000, 2, dtype=np.int64)
    rows = rng.standard_normal((ids.size, 16)).astype(np.float32)
    rows_b = rows.copy()
    rows_b[10] += 0.5            # clearly different
    rows_b[20, 3] += 1e-7        # within a tolerance of 1e-6
    a = {"user": _table("user", ids, rows),
         "item": _table("item", [1, 2, 3], np.ones((3, 4))),
         "ctx": _table("ctx", [5], np.zeros((1, 2))),
         "only_a": _table("only_a", [7, 8], np.ones((2, 3)))}
    ids_b = np.concatenate([ids[1:], [5001, 5003]])  # id 0 only in A; 5001, 5003 only in B
    b = {"user": _table("user", ids_b, np.concatenate([rows_b[1:], np.ones((2, 16))])),
         "item": _table("item", [1, 2, 3], np.ones((3, 4))),
         "ctx": _table("ctx", [5], np.zeros((1, 3))),   # other dim
         "only_b": _table("only_b", [], np.zeros((0, 3)))}  # empty: not a difference
    write_snapshot(tmp_path / "a", tables=a, offsets={0: 10, 1: 4}, seqs={},
                   meta={"model": "m", "topic": "deltas.m"})
    write_snapshot(tmp_path / "b", tables=b, offsets={0: 12, 1: 4}, seqs={},
                   meta={"model": "m", "topic": "deltas.m"})
    return tmp_path / "a", tmp_path / "b", ids


def test_diff_counts_ids_rows_and_max_difference(pair):
    a, b, ids = pair
    rep = diff_snapshots(a, b)
    t = {x.table: x for x in rep.tables}
    assert sorted(t) == ["ctx", "item", "only_a", "only_b", "user"]
    u = t["user"]
    assert (u.ids_a, u.ids_b, u.common) == (1000, 1001, 999)
    assert (u.only_in_a, u.only_in_b) == (1, 2)
    assert u.sample_only_a == [0] and u.sample_only_b == [5001, 5003]
    assert u.differing == 2 and u.sample_differing == [int(ids[10]), int(ids[20])]
    assert u.max_abs_diff == pytest.approx(0.5, abs=1e-6)
    assert not u.equal
    assert t["item"].equal and t["item"].max_abs_diff == 0.0
    assert t["ctx"].dim_mismatch and t["ctx"].max_abs_diff is None and not t["ctx"].equal
    assert (t["only_a"].in_a, t["only_a"].in_b, t["only_a"].only_in_a) == (True, False, 2)
    assert not t["only_a"].equal
    assert t["only_b"].equal  # a missing table compares as an empty one
    assert not rep.equal
    assert rep.offsets_a == {0: 10, 1: 4} and rep.offsets_b == {0: 12, 1: 4}
    text = rep.format_text()
    assert "DIFFERENT dims: A 2, B 3" in text and "offsets differ" in text
    assert "1 ids only in A, 2 only in B, 2 of 999 common rows differ" in text


def test_tolerance_decides_which_rows_differ(pair):
    a, b, ids = pair
    rep = diff_snapshots(a, b, tolerance=1e-6)
    u = next(x for x in rep.tables if x.table == "user")
    assert u.differing == 1 and u.sample_differing == [int(ids[10])]
    assert next(x for x in rep.tables if x.table == "user").max_abs_diff == \
        pytest.approx(0.5, abs=1e-6)
    rep = diff_snapshots(a, b, tolerance=1.0)
    assert next(x for x in rep.tables if x.table == "user").differing == 0
    with pytest.raises(ReplayError, match="tolerance"):
        diff_snapshots(a, b, tolerance=-1)
    with pytest.raises(ReplayError, match="tolerance"):
        diff_tables({}, {}, tolerance=math.inf)


def test_identical_snapshots_and_storage_dtypes(tmp_path):
    ids = np.array([3, 9, 27], np.int64)
    rows = np.array([[0.5, -1.0], [2.0, 0.25], [0.125, 7.0]], np.float32)
    write_snapshot(tmp_path / "x", tables={"t": _table("t", ids, rows)}, offsets={0: 3},
                   seqs={}, meta={})
    write_snapshot(tmp_path / "y", tables={"t": _table("t", ids, rows)}, offsets={0: 3},
                   seqs={}, meta={})
    rep = diff_snapshots(tmp_path / "x", tmp_path / "y")
    assert rep.equal and rep.tables[0].common == 3
    assert "no differences" in rep.format_text()
    # f16 storage of values exact in f16 compares equal to f32 storage; others by value
    half = _table("t", ids, rows, dtype="f16")
    assert diff_tables({"t": half}, {"t": _table("t", ids, rows)}).equal
    odd = _table("t", ids, rows + np.float32(1e-4), dtype="f16")
    d = diff_tables({"t": odd}, {"t": _table("t", ids, rows + np.float32(1e-4))}).tables[0]
    assert d.differing > 0 and 0 < d.max_abs_diff < 1e-2


def test_diff_handles_large_tables_in_chunks():
    n = 150_000  # more than one comparison chunk
    ids = np.arange(n, dtype=np.int64) * 3
    rows = np.random.default_rng(0).standard_normal((n, 4)).astype(np.float32)
    other = rows.copy()
    other[[5, 70_000, 149_999], 1] -= 2.0
    rep = diff_tables({"t": _table("t", ids, rows)}, {"t": _table("t", ids, other)})
    t = rep.tables[0]
    assert t.differing == 3 and t.sample_differing == [15, 210_000, 449_997]
    assert t.max_abs_diff == pytest.approx(2.0, abs=1e-5)


# ----------------------------------------------------------------------------- CLI


def test_cli_diff_exit_codes(pair, tmp_path, capsys):
    a, b, _ = pair
    assert main(["diff", str(a), str(b)]) == 1
    assert "DIFFERENT" in capsys.readouterr().out
    assert main(["diff", str(a), str(a)]) == 0
    assert "no differences" in capsys.readouterr().out
    assert main(["diff", str(a), str(b), "--json", "--tolerance", "1e-6"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["equal"] is False and doc["tolerance"] == 1e-6
    user = next(t for t in doc["tables"] if t["table"] == "user")
    assert (user["only_in_a"], user["only_in_b"], user["differing"]) == (1, 2, 1)


def test_cli_diff_tolerance_from_environment(pair, capsys, monkeypatch):
    a, b, _ = pair
    monkeypatch.setenv("DELTASTREAM_REPLAY_DIFF_TOLERANCE", "10")  # this subcommand's
    monkeypatch.setenv("DELTASTREAM_REPLAY_JSON", "1")  # the tool-wide name
    monkeypatch.setenv("DELTASTREAM_TOLERANCE", "0")  # another tool's: ignored
    assert main(["diff", str(a), str(b)]) == 1  # still: ids only in one, dims differ
    doc = json.loads(capsys.readouterr().out)
    assert doc["tolerance"] == 10.0
    assert next(t for t in doc["tables"] if t["table"] == "user")["differing"] == 0


def _one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err
    return err


def test_cli_diff_input_errors_exit_2(pair, tmp_path, capsys):
    a, b, _ = pair
    # a damaged snapshot: one byte of a rows file flipped
    victim = next((b / "tables").glob("*/rows.npy"))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match="checksum"):
        diff_snapshots(a, b)
    assert main(["diff", str(a), str(b)]) == 2
    _one_line_error(capsys, "checksum mismatch", "rows.npy")
    assert main(["diff", str(a), str(tmp_path / "missing")]) == 2
    _one_line_error(capsys, "no snapshot there")
    assert main(["diff", str(a)]) == 2
    _one_line_error(capsys, "two snapshots")
    assert main(["diff", str(a), str(a), "--rebuild"]) == 2
    _one_line_error(capsys, "either two snapshots or one snapshot with --rebuild")
    assert main(["diff", str(a), "--rebuild"]) == 2
    _one_line_error(capsys, "--bootstrap-servers")
    assert main(["diff", str(a), str(a), "--tolerance", "-3"]) == 2
    _one_line_error(capsys, "--tolerance", "≥ 0")
    assert main(["nonsense"]) == 2
    _one_line_error(capsys, "invalid choice")
    assert main([]) == 2
    _one_line_error(capsys, "required")


def test_cli_bad_environment_value_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setenv("DELTASTREAM_REPLAY_STATS_FROM_OFFSETS", "zero=1")
    assert main(["stats", "--bootstrap-servers", "127.0.0.1:1", "--topic", "t"]) == 2
    _one_line_error(capsys, "DELTASTREAM_REPLAY_STATS_FROM_OFFSETS")


# ----------------------------------------------------------------------------- parsing


def test_parse_time():
    assert parse_time("1700000000000000000") == 1_700_000_000_000_000_000
    assert parse_time(5) == 5
    assert parse_time("1970-01-01T00:00:01Z") == 10**9
    assert parse_time("1970-01-01T00:00:01.000250") == 10**9 + 250_000  # naive = UTC
    assert parse_time("1970-01-01T02:00:00+02:00") == 0
    assert parse_time("2024-05-01 12:00:00z") == 1_714_564_800 * 10**9
    ns = 1_714_564_800_123_456_000
    assert parse_time(format_time(ns)) == ns and format_time(ns).endswith("Z")
    for bad in ("", "yesterday", "-5", "1969-12-31T23:59:59Z", True):
        with pytest.raises(ValueError):
            parse_time(bad)


def test_parse_offsets_and_seq_range():
    assert parse_offsets("0=10,1=5") == {0: 10, 1: 5}
    assert parse_offsets(" 3 = 0 ") == {3: 0}
    for bad in ("", "0:10", "a=1", "0=-1", "0=1,0=2", "0=1,"):
        with pytest.raises(ValueError):
            parse_offsets(bad)
    assert parse_seq_range("10:20") == (10, 20)
    assert parse_seq_range("10:") == (10, None)
    assert parse_seq_range(":20") == (None, 20)
    assert parse_seq_range("7") == (7, 7)
    for bad in ("", "b:c", "20:10", "-1:3"):
        with pytest.raises(ValueError):
            parse_seq_range(bad)


def test_diff_model_help_is_about_diff_not_the_other_subcommands(capsys):
    import pytest as _pytest

    from consumers.replay.cli import build_parser

    with _pytest.raises(SystemExit):
        build_parser().parse_args(["diff", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    text = out[out.index("--model MODEL ") + len("--model MODEL "):].split("[env")[0]
    assert text.startswith("With --rebuild:") and "dump" not in text and "stats" not in text
