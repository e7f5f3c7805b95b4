"""kill -9 the deltastream-sync process at random instants; the end state is bit-identical.

A real ``python -m consumers.sync.cli`` process consumes a pre-filled topic (thousands of
small messages, 4 trainer shards on 2 partitions, mixed wire dtypes, tombstones, ids that
are overwritten many times so order matters). It checkpoints every 25 records and sleeps
1 ms after each record (``tests/integration/slow_sync.py``) so a run takes long enough
to be killed mid-stream. Each incarnation is SIGKILLed either a seeded random number of
records (and microseconds) into its run, or the moment its log says a checkpoint write
began, then restarted from the same state directory. The seeded record counts add up to
more than one partition's records and less than the whole topic, so kills land in both
partitions and the last incarnation still has work. After the kills a last incarnation catches up and is stopped with SIGTERM; its
checkpoint must equal, bit for bit, tables built by applying every message once in order.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from consumers.storage.snapshot import read_snapshot
from deltastream.publishing.publisher import ensure_topic

from .test_sync import Feed, assert_tables_equal

pytestmark = [pytest.mark.slow, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
KILLS = 12
SEED = 20240611


def _spawn(bootstrap: str, topic: str, state: Path, log_path: Path, delay: float):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    # the delay is a test wrapper around the real CLI (tests/integration/slow_sync.py)
    cmd = ["-m", "tests.integration.slow_sync", str(delay)] if delay else \
        ["-m", "consumers.sync.cli"]
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, *cmd, "--bootstrap-servers", bootstrap,
         "--model", "m", "--topic", topic, "--state-dir", str(state),
         "--checkpoint-interval", "0.1", "--checkpoint-messages", "25",
         "--summary-interval", "0", "--log-level", "DEBUG"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc


class LogWatch:
    """Follow a growing log file cheaply (reads only what was appended)."""

    def __init__(self, path: Path, proc) -> None:
        self.path, self.proc, self.text, self._pos = path, proc, "", 0

    def poll(self) -> str:
        with open(self.path, "rb") as f:
            f.seek(self._pos)
            chunk = f.read()
        # only complete lines: a line being written is read on the next poll
        cut = chunk.rfind(b"\n") + 1
        self._pos += cut
        self.text += chunk[:cut].decode(errors="replace")
        return self.text

    def wait(self, pattern: str, timeout: float, after: int = 0, count: int = 1):
        """Wait until ``pattern`` occurs ``count`` times from char ``after``; the last
        match, or None on timeout."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = list(rx.finditer(self.poll(), after))
            if len(found) >= count:
                return found[count - 1]
            if self.proc.poll() is not None:
                raise AssertionError(f"sync process exited with {self.proc.returncode}:\n"
                                     f"{self.poll()[-3000:]}")
            time.sleep(0.0005)
        return None


def _strays(ckpt: Path) -> list[str]:
    """Files in the incremental checkpoint dir that its manifest does not list (left by a
    write that was killed before its commit, or before removing the files it replaced)."""
    try:
        body = json.loads((ckpt / "manifest.json").read_text())
        listed = {"manifest.json", body["base"]["dir"], *(s["file"] for s in body["segments"])}
        return sorted(p.name for p in ckpt.iterdir() if p.name not in listed)
    except (OSError, ValueError, KeyError):
        return []


def _phase(state: Path, text: str, pid: int, old_before: bool) -> str:
    """Where the kill of process ``pid`` landed, from what it left behind."""
    half_written = any(p.name.startswith(f"checkpoint.tmp-{pid}-") for p in state.iterdir()) \
        or bool(_strays(state / "checkpoint"))
    between_renames = not old_before and (state / "checkpoint.old").exists()
    begins = [int(x) for x in re.findall(r"checkpoint (\d+) begin", text)]
    written = [int(x) for x in re.findall(r"checkpoint (\d+) written", text)]
    if half_written or between_renames:
        return "checkpoint-files"  # inside a checkpoint write: files not (yet) committed
    if begins and (not written or begins[-1] > written[-1]):
        return "checkpoint"  # between "begin" and the first file
    last_written = text.rfind(" written in ")
    if re.search(r"offset \d+: applied", text[last_written + 1:]):
        return "apply"  # records applied in memory, not yet in a checkpoint
    return "idle"


def _checkpoint_meta(state: Path):
    for _ in range(50):
        for name in ("checkpoint", "checkpoint.old"):
            try:
                body = json.loads((state / name / "manifest.json").read_text())
                return body["meta"]["checkpoints"], {int(k): v for k, v in
                                                     body["offsets"].items()}
            except (OSError, ValueError, KeyError):
                continue
        time.sleep(0.01)
    return 0, {}


def test_kill_9_at_random_instants_ends_bit_identical(broker, topic_name, tmp_path):
    rng = random.Random(SEED)
    bs = broker.bootstrap_servers
    ensure_topic(bs, topic_name, 2)
    feed = Feed(bs, topic_name, 2, dims={"user": 16, "item": 8}, seed=SEED)
    try:
        total = feed.fill(150, shards=(0, 1, 2, 3), num_shards=4)  # 1200 messages
    finally:
        feed.close()
    end = {0: feed.count[0], 1: feed.count[1]}
    assert total == sum(end.values()) == 1200

    state = tmp_path / "state"
    kills = []
    for i in range(KILLS):
        log_path = tmp_path / f"run{i}.log"
        old_before = (state / "checkpoint.old").exists()
        proc = _spawn(bs, topic_name, state, log_path, delay=0.001)
        watch = LogWatch(log_path, proc)
        try:
            connected = watch.wait(r"-> connected", timeout=60)
            assert connected
            aim = ("checkpoint-base" if i % 6 == 1 else "checkpoint-segment") \
                if i % 3 == 1 else "random"
            if aim != "random":
                # after one checkpoint of this incarnation completed, kill the moment the
                # next one (of the aimed kind: full base or delta segment) begins: inside
                # the checkpoint write (or just before it)
                m = watch.wait(r"checkpoint \d+ written", timeout=20, after=connected.end())
                watch.wait(rf"checkpoint \d+ begin \({aim.split('-')[1]}\)", timeout=10,
                           after=m.end() if m else connected.end())
            else:
                # a random number of records into this incarnation, then a random instant
                # within the next few records (bounded progress per incarnation, so the
                # kills land while there is work left however fast the machine is)
                watch.wait(r"offset \d+: applied", timeout=20, after=connected.end(),
                           count=rng.randint(40, 150))
                time.sleep(rng.uniform(0.0, 0.004))
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=30) == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        text = log_path.read_text(errors="replace")
        phase = _phase(state, text, proc.pid, old_before)
        count, offsets = _checkpoint_meta(state)
        resumed = re.search(r"state from checkpoint .*offsets (\{[^}]*\})", text)
        kills.append({"aim": aim, "phase": phase, "checkpoints": count, "offsets": offsets,
                      "resumed": resumed is not None,
                      "bases": len(re.findall(r" written in [\d.]+ ms \(base", text)),
                      "segments": len(re.findall(r" written in [\d.]+ ms \(segment", text))})

    phases = [k["phase"] for k in kills]
    counts = [k["checkpoints"] for k in kills]
    # the kills landed at different phases, and each incarnation made progress on disk
    assert {"checkpoint", "checkpoint-files"} & set(phases), kills
    # the chain was exercised: delta segments and full base rewrites, across restarts
    assert sum(k["segments"] for k in kills) >= KILLS, kills
    assert sum(k["bases"] > 0 for k in kills) >= KILLS // 2, kills
    assert "apply" in phases, kills
    assert counts == sorted(counts), kills
    advanced = sum(b > a for a, b in zip([0] + counts[:-1], counts, strict=True))
    assert advanced >= KILLS // 2, kills
    assert all(k["resumed"] for k in kills[1:]), kills  # every restart read a checkpoint
    assert kills[-1]["offsets"][0] == end[0] and kills[-1]["offsets"][1] > 0, kills

    # the last incarnation catches up (no delay) and stops cleanly on SIGTERM
    log_path = tmp_path / "final.log"
    proc = _spawn(bs, topic_name, state, log_path, delay=0)
    try:
        assert LogWatch(log_path, proc).wait(r"-> connected", timeout=60)
        deadline = time.monotonic() + 60
        while _checkpoint_meta(state)[1] != end:
            assert time.monotonic() < deadline, "the final run did not catch up"
            assert proc.poll() is None, log_path.read_text()[-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    snap = read_snapshot(state / "checkpoint")
    assert snap.offsets == end
    assert_tables_equal(snap.tables, feed.expected)
    # every (table, shard) stream ends at its last seq: nothing applied twice or skipped
    last = {(s["table"], s["shard"]): s["seq"] for s in snap.seqs["streams"]}
    assert last == {(t, s): 149 for t in ("user", "item") for s in range(4)}
    print("kills (aim, phase, checkpoints, offsets):",
          [(k["aim"], k["phase"], k["checkpoints"], k["offsets"]) for k in kills])
