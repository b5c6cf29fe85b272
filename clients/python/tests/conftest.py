"""Test support: real `pinq serve` processes on 127.0.0.1, stopped by their process id.

The broker binary is `$PINQ_BIN`, else the release build of the repository this package sits in
(`$CARGO_TARGET_DIR/release/pinq` or `target/release/pinq`). Without one the tests are skipped,
unless `PINQ_REQUIRE_PYTHON_CLIENT=1` (set by `.ci/run`): then they fail.
"""

from __future__ import annotations

import hashlib
import os
import queue
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
START_TIMEOUT_S = 30


def pinq_bin() -> str:
    candidates = [
        os.environ.get("PINQ_BIN"),
        os.path.join(os.environ.get("CARGO_TARGET_DIR", ""), "release", "pinq")
        if os.environ.get("CARGO_TARGET_DIR")
        else None,
        os.path.join(REPO, "target", "release", "pinq"),
    ]
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    message = "no pinq binary: set PINQ_BIN or run cargo build --release"
    if os.environ.get("PINQ_REQUIRE_PYTHON_CLIENT") == "1":
        pytest.fail(message)
    pytest.skip(message)


class Broker:
    """One `pinq serve` process. `addr` is its shared client port, `shard_ports` its shards'."""

    def __init__(self, args, env=None, data_dir=None):
        self._tmp = None
        if data_dir is None:
            self._tmp = tempfile.mkdtemp(prefix="pinq-py-")
            data_dir = os.path.join(self._tmp, "data")
        self.data_dir = data_dir
        self.args = list(args)
        self.env = dict(env or {})
        self.lines: "queue.Queue[str]" = queue.Queue()
        self.output: list[str] = []
        self.proc = None
        self.addr = None
        self.shard_ports: list[int] = []

    def start(self, fixed_ports: bool = False) -> "Broker":
        args = list(self.args)
        if not fixed_ports:
            args = ["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                    "--data-dir", self.data_dir] + args
        env = dict(os.environ)
        env.setdefault("RUST_LOG", "warn")
        env.update(self.env)
        self.proc = subprocess.Popen(
            [pinq_bin(), "serve", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.addr is None:
            left = deadline - time.monotonic()
            try:
                line = self.lines.get(timeout=max(0.01, left))
            except queue.Empty:
                line = None
            if line is None or left <= 0:
                self.stop()
                raise RuntimeError("pinq serve did not report its address:\n" + "\n".join(self.output))
            self._parse(line)
        return self

    def _read(self):
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.output.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def _parse(self, line: str) -> None:
        # pinq listening on ADDR with N shard(s) on CPUs [..]; shard ports P,Q
        prefix = "pinq listening on "
        if line.startswith(prefix):
            self.addr = line[len(prefix):].split()[0]
            self.shard_ports = [int(p) for p in line.rsplit("shard ports ", 1)[1].split(",")]

    def signal(self, sig) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        """SIGKILL by process id, then reap."""
        if self.proc is not None:
            self.signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
            self.proc = None

    def cleanup(self) -> None:
        self.stop()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)


_taken: set[int] = set()


def free_port(following: int = 0) -> int:
    """A port on 127.0.0.1 nobody listens on, with `following` free ports after it, none
    handed out before by this process."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        run = range(port, port + following + 1)
        if any(p in _taken or p > 65535 for p in run):
            continue
        ok = True
        for p in run[1:]:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            _taken.update(run)
            return port
    raise RuntimeError("no free run of ports on 127.0.0.1")


class Cluster:
    """Three (or `size`) `pinq serve` members of one Raft cluster on 127.0.0.1, one shard each."""

    def __init__(self, size: int, env=None):
        self.tmp = tempfile.mkdtemp(prefix="pinq-py-cluster-")
        self.members = {}
        for node in range(1, size + 1):
            self.members[node] = {
                "client": f"127.0.0.1:{free_port(1)}",
                "raft": f"127.0.0.1:{free_port()}",
                "metrics": f"127.0.0.1:{free_port()}",
                "data": os.path.join(self.tmp, f"node{node}"),
                "cpus": str((node - 1) % 2),
            }
        peers = ",".join(f"{n}={m['raft']}" for n, m in self.members.items())
        self.brokers = {}
        for node, m in self.members.items():
            args = ["--cpus", m["cpus"], "--node-id", str(node), "--raft-listen", m["raft"],
                    "--peers", peers, "--listen", m["client"], "--metrics-listen", m["metrics"],
                    "--data-dir", m["data"]]
            self.brokers[node] = Broker(args, env, data_dir=m["data"])

    def start(self) -> "Cluster":
        for broker in self.brokers.values():
            broker.start(fixed_ports=True)
        return self

    def addr(self, node: int) -> str:
        return self.members[node]["client"]

    def node_of(self, addr: str) -> int:
        return next(n for n, m in self.members.items() if m["client"] == addr)

    def kill9(self, node: int) -> None:
        self.brokers[node].stop()

    def cleanup(self) -> None:
        for broker in self.brokers.values():
            broker.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


def token_config(path: str, tokens: dict) -> None:
    """Writes a pinq.toml with `[[auth.tokens]]`: name -> (secret, publish, consume, admin)."""
    with open(path, "w", encoding="utf-8") as f:
        for name, (secret, publish, consume, admin) in tokens.items():
            digest = hashlib.sha256(secret.encode()).hexdigest()
            f.write(f'[[auth.tokens]]\nname = "{name}"\nsha256 = "{digest}"\n')
            f.write(f"publish = {publish!r}\nconsume = {consume!r}\n".replace("'", '"'))
            f.write(f"admin = {'true' if admin else 'false'}\n\n")


def make_pki(directory: str) -> None:
    """A CA and a server certificate for localhost and 127.0.0.1, made with openssl."""

    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "30",
            "-subj", "/CN=pinq python test CA")
    with open(os.path.join(directory, "server.ext"), "w", encoding="utf-8") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.pem", "-days", "30", "-extfile", "server.ext")


@pytest.fixture(scope="module")
def broker():
    """A standalone broker with two shards (memory storage), small limits to refuse against."""
    b = Broker(
        ["--storage", "memory", "--cpus", "0,1"],
        env={
            "PINQ_PUBLISH_MAX_MESSAGE_BYTES": "16KiB",
            "PINQ_DELIVERY_DELETE_BATCH_INTERVAL": "50ms",
            "PINQ_DELIVERY_TTL_SWEEP_INTERVAL": "200ms",
        },
    ).start()
    yield b
    b.cleanup()
