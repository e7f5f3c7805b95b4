"""deltastream_demo.options: the demo's flags, DemoOptions and its checks."""

from __future__ import annotations

import argparse

import pytest

from deltastream_demo.options import (
    DEFAULT_BATCH,
    DEFAULT_BUDGET,
    DEFAULT_STEPS,
    DemoOptions,
    add_demo_arguments,
    options_from_args,
)


def _parse(*argv: str) -> DemoOptions:
    p = argparse.ArgumentParser()
    add_demo_arguments(p)
    return options_from_args(p.parse_args(list(argv)))


def test_flags_become_options_with_the_defaults():
    o = _parse()
    assert o == DemoOptions()
    o.validate()
    assert o.resolved_topic == "deltas.demo" and o.resolved_steps == DEFAULT_STEPS
    o = _parse("--workers", "3", "--topk-fraction", "0.5", "--model", "m", "--duration", "5")
    assert (o.workers, o.topk_fraction, o.resolved_topic) == (3, 0.5, "deltas.m")
    assert o.resolved_steps is None  # only --duration: unbounded steps
    assert o.stream_config().n_users == o.users
    assert _parse().publish_budget == DEFAULT_BUDGET > 0  # the budget mode is the default
    assert _parse("--publish-budget", "0").publish_budget == 0.0  # fixed rounds


def test_the_batch_defaults_by_device_and_an_explicit_one_wins():
    assert _parse().resolved_batch_size == DEFAULT_BATCH["cpu"] == 512
    # CUDA's default is larger: a 512-example GPU step is launch- and sync-bound
    assert DemoOptions(device="cuda").resolved_batch_size == DEFAULT_BATCH["cuda"] > 512
    assert DemoOptions(device="cuda", batch_size=512).resolved_batch_size == 512
    assert _parse("--batch-size", "64").resolved_batch_size == 64
    with pytest.raises(ValueError, match=r"--batch-size must be an integer in \[1, 1048576\]"):
        DemoOptions(batch_size=0).validate()


def test_prefetch_is_on_for_cuda_by_default_and_either_way_when_asked():
    assert _parse().resolved_prefetch is False
    assert DemoOptions(device="cuda").resolved_prefetch is True
    assert _parse("--prefetch", "on").resolved_prefetch is True
    assert DemoOptions(device="cuda", prefetch="off").resolved_prefetch is False
    with pytest.raises(ValueError,
                       match=r"--prefetch must be one of \('auto', 'on', 'off'\), got 'yes'"):
        DemoOptions(prefetch="yes").validate()


@pytest.mark.parametrize("field, value, words", [
    ("workers", 0, "--workers must be an integer in [1, 64], got 0"),
    ("topk_fraction", 1.5, "--topk-fraction must be in (0, 1], got 1.5"),
    ("wire_dtype", "f64", "--wire-dtype must be one of"),
    ("max_message_bytes", 4096, "cannot hold one row"),
    ("lr_dense", 0.0, "--lr-dense must be a positive number"),
    ("model_name", "a/b", "--model must be non-empty without '/'"),
    ("duration", -1.0, "--duration must be a positive number of seconds"),
    ("publish_budget", -5.0, "--publish-budget must be a finite number of bytes/s >= 0"),
])
def test_validate_names_the_bad_option(field, value, words):
    kwargs = {field: value}
    if field == "max_message_bytes":
        kwargs["dim"] = 4096
    with pytest.raises(ValueError) as info:
        DemoOptions(**kwargs).validate()
    assert words in str(info.value)


def test_sharding_flag():
    assert _parse().sharding == "row"
    o = _parse("--sharding", "column", "--dim", "8", "--workers", "2")
    assert o.sharding == "column"
    o.validate()
    with pytest.raises(ValueError, match="--sharding must be one of"):
        DemoOptions(sharding="diagonal").validate()
    with pytest.raises(ValueError, match="--dim 2 over --workers 3: needs dim >= workers"):
        DemoOptions(sharding="column", dim=2, workers=3).validate()
    with pytest.raises(SystemExit):
        _parse("--sharding", "diagonal")


def test_model_kind_torchrec_needs_row_sharding():
    pytest.importorskip("torchrec", reason="the TorchRec extra is not installed")
    o = _parse("--model-kind", "torchrec")
    o.validate()
    assert o.stream_config().dense_ids and not DemoOptions().stream_config().dense_ids
    o = _parse("--model-kind", "torchrec", "--sharding", "column")
    with pytest.raises(ValueError, match="--model-kind torchrec .* --sharding row"):
        o.validate()


def test_model_kind_torchrec_without_torchrec_is_a_usage_error(tmp_path):
    """Without TorchRec installed (hidden from ``importlib.util.find_spec`` here) the CLI
    exits 2 naming the flag and the install, before anything is started."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "o"
    code = ("import importlib.util as u, sys; real = u.find_spec; "
            "u.find_spec = lambda n, *a, **k: None if n == 'torchrec' else real(n, *a, **k); "
            "from deltastream.cli import main; "
            f"sys.exit(main(['demo', '--model-kind', 'torchrec', '--out', {str(out)!r}]))")
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "--model-kind torchrec needs TorchRec" in proc.stderr
    assert "deltastream[torchrec]" in proc.stderr
    assert not out.exists()
