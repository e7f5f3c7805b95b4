"""deltastream-replay names a wrong path plainly: a directory given as dump's --out, a
daemon's state dir given to diff instead of its checkpoint."""

from __future__ import annotations

from consumers.replay.cli import main


def test_dump_out_a_directory_is_a_usage_error_naming_it(tmp_path, capsys):
    code = main(["dump", "--bootstrap-servers", "127.0.0.1:1", "--topic", "t",
                 "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and f"--out {tmp_path}: is a directory" in err and "Errno" not in err


def test_diff_of_a_state_dir_points_to_its_checkpoint(tmp_path, capsys):
    state = tmp_path / "state"
    (state / "checkpoint").mkdir(parents=True)
    (state / "checkpoint" / "manifest.json").write_text("{}")
    code = main(["diff", str(state), str(state)])
    err = capsys.readouterr().err
    assert code == 2 and f"give {state / 'checkpoint'}" in err
