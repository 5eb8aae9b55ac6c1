"""Real `redis-server` processes on 127.0.0.1 for the store tests: one server, or a 3-node Redis
Cluster. Each runs without persistence in a temporary directory, is waited for with a bounded
timeout, and is stopped by its PID (SIGTERM, then SIGKILL). `pause()` / `resume()` send
SIGSTOP / SIGCONT: a server that accepts connections and never answers."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

START_TIMEOUT_S = 10.0


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, cluster: bool = False) -> int:
    """A free port on 127.0.0.1; for a cluster node one whose bus port (port + 10000) is free too."""
    if not cluster:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 30000)
        if _bindable(port) and _bindable(port + 10000):
            return port


def need_redis_server() -> None:
    if shutil.which("redis-server") is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is missing: .ci/run installs it")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")


class Server:
    """One `redis-server` on 127.0.0.1 (`extra` adds command-line options, e.g. a maxmemory)."""

    def __init__(self, workdir: Path, *extra: str, cluster: bool = False) -> None:
        self.port, self.workdir, self.extra, self.cluster = free_port(cluster=cluster), workdir, extra, cluster
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), *self.extra]  # fmt: skip
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf",
                     "--cluster-node-timeout", "2000"]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.cli("PING").strip() not in ("PONG", "NOAUTH Authentication required."):  # up (maybe locked)
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            time.sleep(0.05)

    def cli(self, *args: str) -> str:
        """`redis-cli` against this server (bounded), its stdout."""
        done = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(self.port), *args], capture_output=True,
                              text=True, timeout=10)  # fmt: skip
        return done.stdout

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


class Cluster:
    """Three cluster-enabled servers joined into one Redis Cluster (no replicas)."""

    def __init__(self, workdir: Path) -> None:
        self.nodes = [Server(workdir / f"node{i}", cluster=True) for i in range(3)]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        hosts = [f"127.0.0.1:{node.port}" for node in self.nodes]
        subprocess.run(["redis-cli", "--cluster", "create", *hosts, "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=30)  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        while any("cluster_state:ok" not in node.cli("CLUSTER", "INFO") for node in self.nodes):
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the Redis Cluster did not become ready")
            time.sleep(0.1)

    def node_of(self, key: str) -> Server:
        """The node that holds `key`'s slot."""
        slot = int(self.nodes[0].cli("CLUSTER", "KEYSLOT", key).strip())
        for node in self.nodes:
            for line in node.cli("CLUSTER", "NODES").splitlines():
                fields = line.split()
                if "myself" in fields[2]:
                    for span in fields[8:]:
                        low, _, high = span.partition("-")
                        if low.isdigit() and int(low) <= slot <= int(high or low):
                            return node
        raise LookupError(f"no node holds slot {slot}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
