"""The conventions every deltastream CLI follows, tried on the real entry points.

Tool-specific environment variables (a shared one only for shared settings), validated
bootstrap servers, ``deltastream broker`` in the foreground, quiet kafka-python logs, plain
``--help``, Kafka TLS/SASL settings from a file or the environment (never in a log), a
predictor started from several per-shard snapshots, and one exit-code table.
"""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from consumers.serving.table import ServingTable
from consumers.storage.snapshot import read_snapshot, write_snapshot
from consumers.topic import TopicReader
from deltastream.broker import free_port, kafka_ready
from deltastream.cliargs import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
)
from deltastream.publishing.publisher import DeltaPublisher, ensure_topic

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MODEL = "m"
SYNC = ["-m", "consumers.sync.cli"]
REPLAY = ["-m", "consumers.replay.cli"]
DS = ["-m", "deltastream.cli"]
PASSWORD = "s3cret-Pa55-0815"


def _env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTASTREAM_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def _run(args: list[str], *, env: dict | None = None, cwd: Path = REPO,
         timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=_env(env),
                          capture_output=True, text=True, timeout=timeout)


def _one_line(r: subprocess.CompletedProcess, *needles: str) -> str:
    err = r.stderr.strip()
    assert "Traceback" not in err, err
    assert len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err
    return err


@pytest.fixture
def topic_with_data(broker, topic_name):
    """A 2-partition topic with 3 messages of model m (shards 0 and 1)."""
    ensure_topic(broker.bootstrap_servers, topic_name, 2)
    for shard, steps in ((0, 2), (1, 1)):
        with DeltaPublisher(broker.bootstrap_servers, topic_name, model=MODEL,
                            shard=shard) as pub:
            for step in range(steps):
                ids = np.arange(4, dtype=np.int64) * 2 + shard
                pub.publish("user", ids, np.full((4, 3), step + 0.5, np.float32), step=step)
            pub.flush()
    return broker.bootstrap_servers, topic_name


# --------------------------------------------------------------------------- --help

HELP = [DS, [*DS, "demo"], [*DS, "topic"], [*DS, "bench"], [*DS, "broker"], SYNC, REPLAY,
        [*REPLAY, "rebuild"], [*REPLAY, "dump"], [*REPLAY, "stats"], [*REPLAY, "diff"],
        ["-m", "deltastream.broker"], ["-m", "deltastream_demo.run"]]


@pytest.mark.parametrize("cmd", HELP, ids=lambda c: " ".join(c[1:]))
def test_help_is_plain_text_and_names_variables_and_exit_codes(cmd):
    r = _run([*cmd, "--help"], env={"DELTASTREAM_KAFKA_SASL_PASSWORD": PASSWORD})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "(default: None)" not in out and "(default: False)" not in out
    assert "``" not in out and ":mod:" not in out and ":class:" not in out
    assert "exit codes: 0 ok" in re.sub(r"\s+", " ", out)
    assert PASSWORD not in out + r.stderr
    options = out[out.index("\noptions:"):]
    blocks = re.split(r"\n  (?=-)", options)[1:]  # one per flag
    assert blocks
    if cmd == SYNC:  # brief: one sentence per flag, the variables behind --help-env
        env = _run([*cmd, "--help-env"]).stdout
        for block in blocks:
            flag = [f for f in block.split()[:3] if f.startswith("--")][0].rstrip(",")
            if flag not in ("--help", "--help-env"):
                assert re.search(rf"^{flag} +DELTASTREAM_", env, re.M), (flag, env)
        assert len(out.splitlines()) < 130  # it was 161 lines, mostly variable names
        return
    for block in blocks:  # every flag names its DELTASTREAM_ variable(s)
        if not block.startswith("-h, --help"):
            assert "DELTASTREAM_" in re.sub(r"\s+", "", block), block


def test_required_flags_show_no_default():
    r = _run([*SYNC, "--help"])
    text = re.sub(r"\s+", " ", r.stdout)
    for flag in ("--bootstrap-servers HOST:PORT[,...]", "--model MODEL", "--state-dir DIR"):
        block = text[text.index(" " + flag + " "):][:400].split(" --")[1]
        assert "default" not in block, block


# --------------------------------------------------------------------------- point 7


def test_tool_variables_do_not_collide(topic_with_data, tmp_path):
    servers, topic = topic_with_data
    # what another tool's variables used to do to replay: write a file and print nothing,
    # read the wrong partitions, time out at once, filter another model
    foreign = {"DELTASTREAM_OUT": "x.txt", "DELTASTREAM_PARTITIONS": "7",
               "DELTASTREAM_TIMEOUT": "oops", "DELTASTREAM_MODEL": "other",
               "DELTASTREAM_LIMIT": "1", "DELTASTREAM_SYNC_TOPIC": "deltas.nope",
               "DELTASTREAM_REPLAY_OUT": "y.txt"}  # --out reads only ..._DUMP_OUT
    r = _run([*REPLAY, "dump", "--bootstrap-servers", servers, "--topic", topic],
             env=foreign, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 3
    assert not (tmp_path / "x.txt").exists() and not (tmp_path / "y.txt").exists()
    # the tool's own variables: per subcommand, then tool-wide; over the shared ones
    r = _run([*REPLAY, "dump"], cwd=tmp_path, env={
        "DELTASTREAM_BOOTSTRAP_SERVERS": "127.0.0.1:1",
        "DELTASTREAM_REPLAY_BOOTSTRAP_SERVERS": servers,
        "DELTASTREAM_REPLAY_TOPIC": topic, "DELTASTREAM_REPLAY_DUMP_OUT": "lines.jsonl",
        "DELTASTREAM_REPLAY_DUMP_PARTITIONS": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and len((tmp_path / "lines.jsonl").read_text().splitlines()) == 1
    # deltastream topic reads DELTASTREAM_TOPIC_*, not DELTASTREAM_PARTITIONS
    new = topic + "-new"
    r = _run([*DS, "topic"], env={"DELTASTREAM_BOOTSTRAP_SERVERS": servers,
                                  "DELTASTREAM_TOPIC_TOPIC": new,
                                  "DELTASTREAM_TOPIC_PARTITIONS": "3",
                                  "DELTASTREAM_PARTITIONS": "5"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{new}: 3 partitions on {servers}"
    with TopicReader(servers, new) as reader:
        assert reader.partitions == [0, 1, 2]


# --------------------------------------------------------------------------- point 9


@pytest.mark.parametrize("value, why", [("127.0.0.1:abc", "port 'abc' is not a number"),
                                        ("127.0.0.1:99999", "port 99999 is outside 1..65535")])
@pytest.mark.parametrize("cmd", [[*SYNC, "--model", "m", "--state-dir", "s"],
                                 [*REPLAY, "stats", "--topic", "t"], [*DS, "topic"],
                                 [*DS, "demo", "--out", "o"]],
                         ids=["sync", "replay", "topic", "demo"])
def test_bad_bootstrap_servers_are_one_line_exit_2(cmd, value, why, tmp_path):
    r = _run([*cmd, "--bootstrap-servers", value], cwd=tmp_path)
    assert r.returncode == EXIT_USAGE
    _one_line(r, repr(value), why, "host:port")
    assert not any(tmp_path.iterdir())  # nothing was started or written


def test_bad_bootstrap_from_a_variable_names_the_variable(tmp_path):
    r = _run([*SYNC, "--model", "m", "--state-dir", "s"], cwd=tmp_path,
             env={"DELTASTREAM_SYNC_BOOTSTRAP_SERVERS": "127.0.0.1:abc"})
    assert r.returncode == EXIT_USAGE
    _one_line(r, "DELTASTREAM_SYNC_BOOTSTRAP_SERVERS='127.0.0.1:abc'", "is not a number")


def test_a_missing_shm_dir_is_a_usage_error(tmp_path):
    r = _run([*SYNC, "--model", "m", "--state-dir", "s", "--bootstrap-servers",
              "127.0.0.1:9092", "--share-tables", "--shm-dir", "no/such/dir"], cwd=tmp_path)
    assert r.returncode == EXIT_USAGE
    _one_line(r, "--shm-dir", "expected an existing directory, got 'no/such/dir'")
    assert not any(tmp_path.iterdir())  # nothing was started or written


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux affinity")
@pytest.mark.parametrize("value, why", [("3-1", "'3-1' in '3-1' is not a CPU number"),
                                        ("9999", "not among the CPUs this process may run")])
def test_bad_cpus_are_a_usage_error(value, why, tmp_path):
    r = _run([*SYNC, "--model", "m", "--state-dir", "s", "--bootstrap-servers",
              "127.0.0.1:9092", "--cpus", value], cwd=tmp_path)
    assert r.returncode == EXIT_USAGE
    _one_line(r, "--cpus", why)
    assert not any(tmp_path.iterdir())  # nothing was started or written


def test_a_state_dir_that_is_a_file_is_one_plain_line_exit_2(tmp_path):
    (tmp_path / "afile").write_text("mine")
    r = _run([*SYNC, "--model", "m", "--state-dir", "afile", "--bootstrap-servers",
              "127.0.0.1:9092"], cwd=tmp_path)
    assert r.returncode == EXIT_USAGE
    err = _one_line(r, "--state-dir afile", "exists and is not a directory")
    assert "Errno" not in err
    assert (tmp_path / "afile").read_text() == "mine"  # what we did not write is kept


def test_a_busy_metrics_port_names_the_port_and_the_flag_exit_2(tmp_path):
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        busy = s.getsockname()[1]
        r = _run([*SYNC, "--model", "m", "--state-dir", "s", "--bootstrap-servers",
                  "127.0.0.1:9092", "--metrics-port", str(busy)], cwd=tmp_path)
    assert r.returncode == EXIT_USAGE
    err = _one_line(r, f"--metrics-port {busy}", f"0.0.0.0:{busy}", "address already in use")
    assert "Errno" not in err


def test_topic_partitions_zero_is_a_usage_error():
    r = _run([*DS, "topic", "--bootstrap-servers", "127.0.0.1:9092", "--partitions", "0"])
    assert r.returncode == EXIT_USAGE
    _one_line(r, "--partitions", "expected an integer ≥ 1, got '0'")


# --------------------------------------------------------------------------- point 10


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the broker printed no address in time"
    return proc.stdout.readline().strip()


@pytest.mark.parametrize("cmd, sig", [(["-m", "deltastream.broker"], signal.SIGTERM),
                                      ([*DS, "broker"], signal.SIGINT)],
                         ids=["python -m deltastream.broker", "deltastream broker"])
def test_broker_runs_in_the_foreground(cmd, sig, topic_name):
    proc = subprocess.Popen([sys.executable, *cmd, "--port", "0"], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        addr = _read_line(proc, 60)
        assert re.fullmatch(r"127\.0\.0\.1:\d+", addr), addr
        port = int(addr.rsplit(":", 1)[1])
        r = _run([*DS, "topic", "--bootstrap-servers", addr, "--topic", topic_name,
                  "--partitions", "2"])
        assert r.returncode == 0 and "2 partitions" in r.stdout, r.stderr
        with DeltaPublisher(addr, topic_name, model=MODEL, shard=1) as pub:
            pub.publish("user", np.array([1, 3]), np.ones((2, 2), np.float32), step=0)
            pub.flush()
        with TopicReader(addr, topic_name) as reader:
            assert reader.end_offsets() == {0: 0, 1: 1}
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == EXIT_OK, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in proc.stderr.read()
    assert not kafka_ready("127.0.0.1", port)
    with socket.socket() as s:  # the port is free again
        s.bind(("127.0.0.1", port))


def test_broker_on_a_taken_port_exits_3():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _run([*DS, "broker", "--port", str(port)], timeout=120)
    assert r.returncode == EXIT_UNAVAILABLE
    assert "deltastream broker: error" in r.stderr and "Traceback" not in r.stderr


# --------------------------------------------------------------------------- point 11


def test_kafka_python_is_quiet_unless_verbose(broker, topic_name):
    base = [*DS, "topic", "--bootstrap-servers", broker.bootstrap_servers]
    r = _run([*base, "--topic", topic_name])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{topic_name}: 1 partitions on {broker.bootstrap_servers}"
    assert " kafka." not in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.splitlines()) <= 1  # at most our own "created topic" line
    r = _run([*base, "--topic", topic_name, "-v"])
    assert r.returncode == 0 and " kafka." in r.stderr  # -v shows kafka-python's lines


REFUSED = {"topic": [*DS, "topic"], "demo": [*DS, "demo", "--steps", "10", "--out", "o"],
           "replay stats": [*REPLAY, "stats", "--topic", "t"],
           "replay dump": [*REPLAY, "dump", "--topic", "t"],
           "replay rebuild": [*REPLAY, "rebuild", "--model", "m", "--out", "o"],
           "replay diff": [*REPLAY, "diff", "snap", "--rebuild", "--model", "m"]}


@pytest.mark.parametrize("names", [["topic", "demo", "replay stats"],
                                   ["replay dump", "replay rebuild", "replay diff"]],
                         ids=["ds", "replay"])
def test_a_refused_address_is_one_line_exit_3_at_once(names, tmp_path):
    """Nothing listens there: the one-shot tools say so after a 5 s grace (a broker started
    just before in the background gets that long to listen), not after their 30 s timeout.
    Three tools at a time (each mostly waits out its grace), each timed on its own."""
    from concurrent.futures import ThreadPoolExecutor

    def one(name: str) -> tuple[str, int, subprocess.CompletedProcess, float]:
        port, cwd = free_port(), tmp_path / name.replace(" ", "-")
        cwd.mkdir()
        t0 = time.monotonic()
        r = _run([*REFUSED[name], "--bootstrap-servers", f"127.0.0.1:{port}"], cwd=cwd)
        return name, port, r, time.monotonic() - t0

    with ThreadPoolExecutor(len(names)) as pool:
        done = list(pool.map(one, names))
    for name, port, r, took in done:
        assert r.returncode == EXIT_UNAVAILABLE, (name, r.stderr)
        assert took < 20, name  # the tools' own timeouts are 30 s
        err = _one_line(r, f"nothing listens on 127.0.0.1:{port} (connection refused for 5 s)")
        assert "KafkaTimeoutError" not in err, name


# --------------------------------------------------------------------------- point 16


def _ssl_file(tmp_path: Path) -> Path:
    p = tmp_path / "ssl.properties"
    p.write_text("# a TLS listener is expected\nsecurity.protocol=SSL\n"
                 "ssl.check.hostname=false\n")
    return p


def test_tls_against_a_plaintext_broker_fails_in_one_line(broker, topic_name, tmp_path):
    ssl_file = str(_ssl_file(tmp_path))
    ensure_topic(broker.bootstrap_servers, topic_name, 1)
    src = ["--bootstrap-servers", broker.bootstrap_servers, "--kafka-config", ssl_file]
    for cmd in ([*DS, "topic", *src, "--topic", topic_name, "--timeout", "1"],
                [*REPLAY, "stats", *src, "--topic", topic_name, "--timeout", "1"],
                [*SYNC, *src, "--topic", topic_name, "--model", MODEL, "--state-dir",
                 str(tmp_path / "state"), "--request-timeout", "1"]):
        t0 = time.monotonic()
        r = _run(cmd, timeout=60)
        assert r.returncode == EXIT_UNAVAILABLE, (cmd, r.stderr)
        _one_line(r, "TLS handshake", "plaintext listener")
        assert time.monotonic() - t0 < 30
    # the same settings from the environment
    r = _run([*DS, "topic", "--bootstrap-servers", broker.bootstrap_servers, "--topic",
              topic_name, "--timeout", "1"],
             env={"DELTASTREAM_KAFKA_SECURITY_PROTOCOL": "SSL"})
    assert r.returncode == EXIT_UNAVAILABLE and "TLS handshake" in r.stderr


def test_sasl_password_never_reaches_a_log(broker, topic_name):
    env = {"DELTASTREAM_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
           "DELTASTREAM_KAFKA_SASL_MECHANISM": "PLAIN",
           "DELTASTREAM_KAFKA_SASL_USERNAME": "svc",
           "DELTASTREAM_TOPIC_KAFKA_SASL_PASSWORD": PASSWORD}
    r = _run([*DS, "--log-level", "DEBUG", "-v", "topic", "--bootstrap-servers",
              broker.bootstrap_servers, "--topic", topic_name, "--timeout", "2"], env=env)
    # the embedded broker does not speak SASL: refused, and kafka-python said why
    assert r.returncode == EXIT_UNAVAILABLE
    assert PASSWORD not in r.stdout + r.stderr
    assert "'sasl_plain_password': '***'" in r.stderr  # its DEBUG config line, redacted
    r = _run([*DS, "topic", "--bootstrap-servers", broker.bootstrap_servers, "--topic",
              topic_name, "--timeout", "2"], env=env)
    assert r.returncode == EXIT_UNAVAILABLE
    _one_line(r, "cannot reach Kafka")
    assert PASSWORD not in r.stderr


@pytest.mark.parametrize("cmd", [[*DS, "topic"], SYNC, [*REPLAY, "stats"], [*DS, "demo"]],
                         ids=["topic", "sync", "replay", "demo"])
def test_bad_kafka_settings_are_usage_errors(cmd, tmp_path):
    p = tmp_path / "client.properties"
    p.write_text("security.protocol=SASL_SSL\nsasl.mechanism=PLAIN\nsasl.pasword=x\n")
    rest = {"topic": [], "stats": ["--topic", "t"], "demo": ["--out", str(tmp_path / "o")]}
    r = _run([*cmd, "--bootstrap-servers", "127.0.0.1:9092", "--kafka-config", str(p),
              *rest.get(cmd[-1], ["--model", "m", "--state-dir", str(tmp_path / "s")])])
    assert r.returncode == EXIT_USAGE
    _one_line(r, "unknown Kafka setting 'sasl.pasword'")
    assert not (tmp_path / "s").exists() and not (tmp_path / "o").exists()


# --------------------------------------------------------------------------- point 12


def _shard_snapshot(path: Path, shard: int, topic: str, **meta) -> None:
    ids = np.arange(3, dtype=np.int64) * 2 + shard
    write_snapshot(path, tables={"user": ServingTable.from_arrays(
        "user", ids, np.full((3, 2), shard + 1.0, np.float32))}, offsets={shard: 0},
        seqs={}, meta={"model": MODEL, "topic": topic, "shard": shard, **meta})


def _sync_until_started(args: list[str], tmp_path: Path) -> tuple[int, str]:
    """Run deltastream-sync until it logs its start, SIGTERM it; (exit code, stderr)."""
    log_path = tmp_path / f"sync-{time.monotonic_ns()}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, *SYNC, *args], cwd=REPO, env=_env(),
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while proc.poll() is None and time.monotonic() < deadline:
                if "deltastream-sync: model" in log_path.read_text():
                    proc.send_signal(signal.SIGTERM)
                    break
                time.sleep(0.1)
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    return code, log_path.read_text()


def test_sync_starts_from_several_shard_snapshots(broker, topic_name, tmp_path):
    ensure_topic(broker.bootstrap_servers, topic_name, 2)
    a, b, c = tmp_path / "shard-0", tmp_path / "shard-1", tmp_path / "other"
    _shard_snapshot(a, 0, topic_name)
    _shard_snapshot(b, 1, topic_name)
    common = ["--bootstrap-servers", broker.bootstrap_servers, "--topic", topic_name,
              "--model", MODEL, "--checkpoint-interval", "60", "--summary-interval", "0"]
    for i, base in enumerate((["--base", str(a), "--base", str(b)],
                              ["--base", f"{a},{b}"])):
        state = tmp_path / f"state{i}"
        code, out = _sync_until_started([*common, "--state-dir", str(state), *base],
                                        tmp_path)
        assert code == EXIT_OK, out
        snap = read_snapshot(state / "checkpoint")
        assert sorted(snap.tables["user"].ids().tolist()) == [0, 1, 2, 3, 4, 5]
        assert snap.offsets == {0: 0, 1: 0}
    # overlapping shards: refused, naming the table
    _shard_snapshot(c, 0, topic_name)
    r = _run([*SYNC, *common, "--state-dir", str(tmp_path / "s2"), "--base", f"{a},{c}"])
    assert r.returncode == EXIT_USAGE
    _one_line(r, "cannot merge", "table 'user'")
    # a snapshot of another topic: refused naming both, unless --base-any-topic
    d = tmp_path / "demo-topic"
    _shard_snapshot(d, 0, "deltas.demo")
    r = _run([*SYNC, *common, "--state-dir", str(tmp_path / "s3"), "--base", str(d)])
    assert r.returncode == EXIT_USAGE
    _one_line(r, "'deltas.demo'", repr(topic_name), "--base-any-topic")
    code, out = _sync_until_started([*common, "--state-dir", str(tmp_path / "s4"),
                                     "--base", str(d), "--base-any-topic"], tmp_path)
    assert code == EXIT_OK and "is a snapshot of topic 'deltas.demo'" in out, out


# --------------------------------------------------------------------------- exit codes


def test_exit_code_table_in_the_readme():
    text = (REPO / "README.md").read_text()
    section = text[text.index("### Exit codes"):]
    rows = dict(re.findall(r"^\| (\d+) \| ([^|]+)\|", section, re.M))
    assert {int(k) for k in rows} == {EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE,
                                      EXIT_INTERRUPTED}


def test_readme_try_it_without_kafka_runs(tmp_path):
    """The README's shell example: broker in the background, topic, replay stats."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    block = next(b for b in blocks if "deltastream broker" in b)
    port = free_port()
    script = ("set -e\n" + block.replace("9092", str(port))
              + "kill %1\nwait %1\n")  # SIGTERM stops the broker with exit 0
    env = _env()
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    r = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"deltas.ctr: 2 partitions on 127.0.0.1:{port}" in r.stdout
    assert "Traceback" not in r.stderr


def test_damaged_state_is_an_input_error(tmp_path):
    ckpt = tmp_path / "state" / "checkpoint"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text("{not json")
    r = _run([*SYNC, "--bootstrap-servers", "127.0.0.1:9", "--model", MODEL, "--state-dir",
              str(tmp_path / "state")])
    assert r.returncode == EXIT_USAGE
    _one_line(r, "manifest.json")


def test_readme_properties_example_is_valid(tmp_path):
    from deltastream.kafka_config import security_config

    text = (REPO / "README.md").read_text()
    block = re.search(r"```properties\n(.*?)```", text, re.S).group(1)
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    p = tmp_path / "client.properties"
    p.write_text(block.replace("/etc/kafka/ca.pem", str(ca)))
    cfg = security_config(p, environ={"DELTASTREAM_KAFKA_SASL_PASSWORD": "pw"})
    assert cfg == {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
                   "sasl_plain_username": "predictor", "sasl_plain_password": "pw",
                   "ssl_cafile": str(ca)}


def _default_sigint() -> None:
    """In the child: Ctrl-C's default action, whatever this process inherited (a runner
    started in the background ignores SIGINT, and so would the child's Python)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_is_exit_130_with_one_line():
    """A replay waiting for a broker that never answers, interrupted once it is waiting
    (it has connected): no race with the interpreter's start on a loaded machine."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(60)
        port = silent.getsockname()[1]
        proc = subprocess.Popen([sys.executable, *REPLAY, "stats", "--bootstrap-servers",
                                 f"127.0.0.1:{port}", "--topic", "t", "--timeout", "60"],
                                cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
        try:
            conn, _ = silent.accept()  # connected: now it waits for an answer that never comes
            with conn:
                proc.send_signal(signal.SIGINT)
                out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == EXIT_INTERRUPTED
    assert err.strip() == "deltastream-replay stats: interrupted", err


# --------------------------------------------------------------------------- sync start-up


def _last_line(r: subprocess.CompletedProcess) -> str:
    """The daemon logs at INFO; its error is the last line of stderr."""
    assert "Traceback" not in r.stderr, r.stderr
    return r.stderr.strip().splitlines()[-1]


def test_sync_startup_timeout_without_a_broker_exits_3(tmp_path):
    port = free_port()
    r = _run([*SYNC, "--model", "m", "--state-dir", "s", "--bootstrap-servers",
              f"127.0.0.1:{port}", "--startup-timeout", "1"], cwd=tmp_path)
    assert r.returncode == EXIT_UNAVAILABLE, r.stderr
    last = _last_line(r)
    assert last.startswith("deltastream-sync: error: not syncing after 1 s "
                           "(--startup-timeout)") and f"127.0.0.1:{port}" in last


def test_sync_startup_timeout_on_a_missing_topic_exits_3(broker, topic_name, tmp_path):
    r = _run([*SYNC, "--model", "m", "--topic", topic_name, "--state-dir", "s",
              "--bootstrap-servers", broker.bootstrap_servers, "--startup-timeout", "1"],
             cwd=tmp_path)
    assert r.returncode == EXIT_UNAVAILABLE, r.stderr
    assert "topic missing" in _last_line(r)


def test_sync_startup_timeout_with_a_wrong_model_exits_2(topic_with_data, tmp_path):
    servers, topic = topic_with_data
    r = _run([*SYNC, "--model", "nope", "--topic", topic, "--state-dir", "s",
              "--bootstrap-servers", servers, "--startup-timeout", "2"], cwd=tmp_path)
    assert r.returncode == EXIT_USAGE, r.stderr
    last = _last_line(r)
    assert f"messages of other models ({MODEL})" in last and "none of model 'nope'" in last


def test_sync_shards_beyond_the_partitions_are_named_in_a_warning(topic_with_data,
                                                                   tmp_path, caplog):
    """--shards 5 on 2 partitions reads partition 1 (shard s goes to s % partitions): one
    WARNING says so; the daemon then applies shard 5's messages only (there are none)."""
    import logging

    from consumers.sync import SyncDaemon

    servers, topic = topic_with_data
    caplog.set_level(logging.WARNING, logger="consumers.sync.source")
    d = SyncDaemon(servers, topic, model=MODEL, state_dir=tmp_path / "s", shards=[5])
    try:
        assert d.catch_up(timeout=30)
        st = d.stats()
    finally:
        d.stop()
    warning = [r.getMessage() for r in caplog.records if "--shards right?" in r.getMessage()]
    assert len(warning) == 1 and "shard 5 read from partition 1" in warning[0]
    assert st["applied"] == 0 and st["skipped"] == 1  # shard 1's message, not shard 5's
