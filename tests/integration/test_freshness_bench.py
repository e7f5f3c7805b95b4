"""The freshness-per-byte benchmark end to end on a small synthetic log (CI never needs the
real one), its log parser, its cache, and its loud exit when no log can be had."""

from __future__ import annotations

import importlib.util
import zipfile

import numpy as np
import pytest

from bench import _ratings
from bench import freshness_per_byte as bench

pytestmark = pytest.mark.integration


def _write_log(path, n=2000, users=40, items=60, seed=0, sep="\t", header=True) -> None:
    rng = np.random.default_rng(seed)
    u = rng.integers(0, users, n)
    i = rng.zipf(1.5, n) % items
    # users like items of their own parity: something to learn
    r = np.where((u + i) % 2 == 0, rng.integers(3, 6, n), rng.integers(1, 4, n))
    ts = 880_000_000 + rng.permutation(n)  # out of order in the file
    lines = [f"user_id:token{sep}item_id:token{sep}rating:float{sep}timestamp:float"] \
        if header else []
    lines += [f"{a}{sep}{b}{sep}{c}{sep}{d}" for a, b, c, d in zip(u, i, r, ts, strict=True)]
    path.write_text("\n".join(lines) + "\n")


def test_parse_log_orders_by_time_maps_ids_and_names_bad_lines(tmp_path):
    r = _ratings.parse_log(b"7::b::5::30\n7::a::1::10\n9::b::4::20\n", "x")
    assert r.ts.tolist() == [10, 20, 30]
    assert r.users.tolist() == [0, 1, 0] and r.items.tolist() == [0, 1, 1]
    assert r.ratings.tolist() == [1.0, 4.0, 5.0] and (r.n_users, r.n_items) == (2, 2)
    with pytest.raises(ValueError, match="line 3 has 2 fields"):
        _ratings.parse_log(b"u,i,r,t\n1,2,3,4\n1,2\n", "x")
    with pytest.raises(ValueError, match="must be numbers"):
        _ratings.parse_log(b"1\t2\t3\t4\n1\t2\tx\t4\n", "x")


def test_the_log_is_read_from_a_wheel_and_cached_once(tmp_path):
    log = tmp_path / "ml.inter"
    _write_log(log, n=50)
    wheel = tmp_path / "recbole-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(log, _ratings.RECBOLE_INTER)
    cache = tmp_path / "cache"
    a = _ratings.load_ratings(None, str(wheel), cache)
    assert len(a) == 50 and "wheel" in a.source
    assert len(list(cache.glob("ratings-*.npz"))) == 1
    b = _ratings.load_ratings(None, str(wheel), cache)  # from the cache
    assert np.array_equal(a.users, b.users) and b.source == a.source
    # a wheel downloaded into the cache directory is found without --wheel
    (cache / wheel.name).write_bytes(wheel.read_bytes())
    assert _ratings.find_source(None, None, cache) == ("wheel", str(cache / wheel.name))


def test_bench_runs_on_a_synthetic_log_and_reports_every_policy(tmp_path):
    log = tmp_path / "ratings.tsv"
    _write_log(log)
    out = bench.main([
        "--log", str(log), "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "png"),
        "--batch-size", "64", "--dim", "8", "--full-every", "4", "--touched-every", "1,4",
        "--fractions", "0.2", "--thresholds", "0.1", "--budgets", "300,1500",
        "--raw-budgets", "", "--by-error-budgets", "300", "--policy", "budget=1500"])
    by = {r["name"]: r for r in out}
    head = by["freshness_bytes_vs_touched"]
    assert head["policy"] == "budget=1500" and head["pass"] in (True, False)
    assert head["ratio"] == pytest.approx(head["value"] / head["baseline"])
    labels = {"full/4", "touched/1", "touched/4", "fraction=0.2", "threshold=0.1",
              "budget=300", "budget=1500", "budget-by-error=300"}
    assert {k.split("@", 1)[1] for k in by if k.startswith("freshness_auc@")} == labels
    base = by["freshness_auc@touched/1"]
    assert base["bytes_ratio"] == 1.0
    assert abs(base["auc_gap"]) < 2e-3  # every touched row every step: only f16 rounding
    assert base["max_row_error"] < 1e-2
    small, big = by["freshness_auc@budget=300"], by["freshness_auc@budget=1500"]
    steps = head["steps"]
    # a budget spends at most its rate (+ the first burst) and serves with a bound
    assert small["bytes"] <= 300 * steps + 4 * 300 + 256
    assert small["bytes"] < big["bytes"] <= 1500 * steps + 4 * 1500 + 256
    assert 0 < small["bound"]["p50"] <= small["bound"]["p99"] <= small["bound"]["max"]
    assert set(small["table_bounds"]) <= {"user", "item", "user_bias", "item_bias"}
    assert (tmp_path / "png" / "freshness_per_byte.png").is_file() or head["plot"] is None


def test_wire_v3_sends_the_same_rows_in_fewer_bytes_and_a_budget_buys_more_rows(tmp_path):
    """--wire-version 3: a policy that does not look at bytes (touched/1) sends the very same
    rows and serves the same AUC in fewer bytes; a byte budget spends the same rate on more
    rows."""
    log = tmp_path / "ratings.tsv"
    _write_log(log, n=1200)
    got = {}
    for version in ("2", "3"):
        out = bench.main([
            "--log", str(log), "--cache", str(tmp_path / "cache"), "--out", str(tmp_path),
            "--batch-size", "64", "--dim", "8", "--full-every", "4", "--touched-every", "1",
            "--fractions", "0.2", "--thresholds", "0.1", "--budgets", "300",
            "--raw-budgets", "", "--by-error-budgets", "", "--policy", "budget=300",
            "--wire-version", version])
        got[version] = {r["policy"]: r for r in out if r["name"].startswith("freshness_auc@")}
    two, three = got["2"], got["3"]
    for label in ("touched/1", "fraction=0.2", "threshold=0.1", "full/4"):
        assert three[label]["rows"] == two[label]["rows"]
        assert three[label]["auc_gap"] == two[label]["auc_gap"]
        assert three[label]["bytes"] < two[label]["bytes"]
    assert three["budget=300"]["rows"] > two["budget=300"]["rows"]
    assert three["budget=300"]["bytes"] <= 300 * three["budget=300"]["steps"] + 4 * 300 + 256


def test_transport_measures_the_messages_each_analysed_policy_sent(tmp_path):
    """--transport: touched/1, the headline policy and the cheapest one within tolerance get
    a transport@ record over exactly the bytes and rows they sent."""
    log = tmp_path / "ratings.tsv"
    _write_log(log, n=1200)
    out = bench.main([
        "--log", str(log), "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "png"),
        "--batch-size", "64", "--dim", "8", "--full-every", "4", "--touched-every", "1",
        "--fractions", "0.2", "--thresholds", "0.1", "--budgets", "1500", "--raw-budgets", "",
        "--by-error-budgets", "", "--policy", "budget=1500", "--transport"])
    by = {r["name"]: r for r in out}
    cheapest = by.get("freshness_cheapest_within_tolerance", {}).get("policy")
    picked = {"touched/1", "budget=1500"} | ({cheapest} if cheapest else set())
    assert {k.split("@", 1)[1] for k in by if k.startswith("transport@")} == picked
    for label in picked:
        t, sent = by[f"transport@{label}"]["transport"], by[f"freshness_auc@{label}"]
        assert (t["bytes"], t["rows"], t["messages"]) == \
            (sent["bytes"], sent["rows"], sent["messages"])
        assert t["ids"] == 8 * t["rows"] and set(t["per_message"]) >= {"gzip"}
        assert by[f"transport@{label}"]["value"] == min(t["per_message"].values())


def test_without_a_log_a_failed_fetch_fails_loudly_and_says_how_to_get_one(tmp_path,
                                                                          monkeypatch):
    """No log anywhere and the wheel cannot be fetched (a real pip run for a package that
    does not exist): the bench exits non-zero naming the failure and how to get a log —
    it never passes by measuring nothing."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "recbole" else real(name, *a))
    monkeypatch.setattr(_ratings, "RECBOLE_SPEC", "deltastream-no-such-package==0.0.1")
    with pytest.raises(SystemExit) as e:
        bench.main(["--cache", str(tmp_path)])
    text = str(e.value.code)
    assert "error" in text and "deltastream-no-such-package" in text
    assert "pip download --no-deps recbole" in text and "--log" in text
    with pytest.raises(_ratings.LogUnavailable, match="pip download"):
        _ratings.load_ratings(None, None, tmp_path, fetch=False)


def test_seeds_report_the_mean_gap_and_each_seeds(tmp_path):
    """--seeds 2: each figure is the mean over two runs with different seeds, and each
    policy's gap per seed is kept; the first seed's run alone reads its own gap."""
    log = tmp_path / "ratings.tsv"
    _write_log(log, n=1200)
    argv = ["--log", str(log), "--cache", str(tmp_path / "cache"), "--out", str(tmp_path),
            "--batch-size", "64", "--dim", "8", "--full-every", "", "--touched-every", "1",
            "--fractions", "", "--thresholds", "0.1", "--budgets", "300",
            "--raw-budgets", "", "--by-error-budgets", "", "--policy", "budget=300",
            "--sim-budgets", "300", "--seed", "3"]
    two = {r["name"]: r for r in bench.main(argv + ["--seeds", "2"])}
    one = {r["name"]: r for r in bench.main(argv)}
    for name in ("freshness_auc@budget=300", "freshness_auc@threshold=0.1",
                 "freshness_auc@sim-res1=300"):
        gaps = two[name]["auc_gaps"]
        assert len(gaps) == 2 and gaps[0] != gaps[1], name  # two trajectories
        assert two[name]["auc_gap"] == pytest.approx(np.mean(gaps), abs=1e-12)
        assert gaps[0] == pytest.approx(one[name]["auc_gap"], abs=1e-12)  # seed 3 alone
        assert one[name]["auc_gaps"] == [one[name]["auc_gap"]]
    head = two["freshness_bytes_vs_touched"]
    assert head["seeds"] == [3, 4] and "the mean of 2 seeds" in head["note"]
    assert head["auc_gap"] == two["freshness_auc@budget=300"]["auc_gap"]
    with pytest.raises(SystemExit):
        bench.main(argv + ["--seeds", "0"])
