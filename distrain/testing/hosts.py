"""A multi-host test bed on one machine, for tests/test_hosts.py and the benchmarks: each "host" is a
network namespace with its own address and its own interface name, joined to the others by a veth pair
to a bridge in a namespace of its own, and runs a Ray node (`ray start`). Traffic stays inside these
namespaces. Everything is ended by PID and removed on `close()`, also when a test fails; namespaces a
crashed earlier run left behind are removed on the next start.

Needs root (`ip netns`); `unavailable()` says why not, for a skip.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
PREFIX = "dtr"  # every namespace of a bed is named dtr<pid>-..., so leftovers of dead runs can be found
SUBNET = "10.213.7"  # /24, private, inside the bed's namespaces only
DASHBOARD_PORT = 8265
GCS_PORT = 6379


def sh(*cmd: str, timeout: float = 30) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")
    return out.stdout


def unavailable() -> str | None:
    """Why the bed cannot run here, or None."""
    if os.geteuid() != 0:
        return "multi-host tests need root for ip netns"
    if not shutil.which("ip"):
        return "multi-host tests need iproute2 (ip)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        sh("ip", "netns", "add", probe)
        sh("ip", "netns", "del", probe)
    except (RuntimeError, OSError) as e:
        return f"ip netns does not work here: {e}"
    return None


def pids_in(namespace: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def kill_all_in(namespace: str, timeout_s: float = 15.0) -> None:
    """SIGKILL every process in the namespace until none is left (Ray starts some as others end)."""
    deadline = time.monotonic() + timeout_s
    while pids := pids_in(namespace):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} in namespace {namespace} survived SIGKILL")
        time.sleep(0.1)


def remove_leftovers() -> None:
    """Namespaces of beds whose test process is gone (a run killed before it could clean up)."""
    for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        owner = name[len(PREFIX) :].split("-")[0]
        if name.startswith(PREFIX) and owner.isdigit() and not Path(f"/proc/{owner}").exists():
            kill_all_in(name)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@dataclass
class Host:
    index: int
    namespace: str
    address: str
    interface: str  # the name of its one network interface: different on every host, as on real clusters
    temp_dir: str
    ray: subprocess.Popen | None = None

    @property
    def cache_dir(self) -> str:
        """The host's own local disk for distrain's caches (DISTRAIN_CACHE_DIR of its Ray node): a run on an
        object store keeps its mirror there, never in a folder another host reads."""
        return f"{self.temp_dir}/cache"


class Bed:
    """Hosts on a bridge; the first to start is the Ray head. `env` is what every Ray process and client
    gets: multi-node Ray inside namespaces needs RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 and token auth."""

    def __init__(self, cpus_per_host: float = 1):
        self.tag = f"{PREFIX}{os.getpid()}"
        self.bridge = f"{self.tag}-br"
        self.cpus_per_host = cpus_per_host
        self.hosts: list[Host] = []
        self.env = {
            **os.environ,
            "PATH": f"{BIN}:{os.environ['PATH']}",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
            "RAY_AUTH_MODE": "token",
            "RAY_USAGE_STATS_ENABLED": "0",
            # A lost host is declared dead within seconds, not Ray's default half minute.
            "RAY_health_check_period_ms": "1000",
            "RAY_health_check_timeout_ms": "1000",
            "RAY_health_check_failure_threshold": "3",
        }
        for key in ("RAY_ADDRESS", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            self.env.pop(key, None)
        remove_leftovers()
        sh("ip", "netns", "add", self.bridge)
        self._in(self.bridge, "ip", "link", "add", "br0", "type", "bridge")
        self._in(self.bridge, "ip", "link", "set", "br0", "up")

    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def dashboard(self) -> str:
        return f"http://{self.head.address}:{DASHBOARD_PORT}"

    def _in(self, namespace: str, *cmd: str) -> str:
        return sh("ip", "netns", "exec", namespace, *cmd)

    def add_host(self) -> Host:
        """A namespace with its address, joined to the bridge, running a Ray node (the head if first)."""
        i = len(self.hosts)
        host = Host(
            index=i,
            namespace=f"{self.tag}-h{i}",
            address=f"{SUBNET}.{i + 1}",
            interface=f"net{i}h",
            temp_dir=tempfile.mkdtemp(prefix=f"ray{i}", dir="/tmp"),  # short: Ray's socket paths are limited
        )
        self.hosts.append(host)
        sh("ip", "netns", "add", host.namespace)
        port = self._port(host)
        veth = ["ip", "link", "add", port, "type", "veth", "peer", "name", host.interface, "netns", host.namespace]
        self._in(self.bridge, *veth)
        self._in(self.bridge, "ip", "link", "set", port, "master", "br0", "up")
        self._in(host.namespace, "ip", "link", "set", "lo", "up")
        self._in(host.namespace, "ip", "addr", "add", f"{host.address}/24", "dev", host.interface)
        self._in(host.namespace, "ip", "link", "set", host.interface, "up")
        self._start_ray(host)
        return host

    def _start_ray(self, host: Host) -> None:
        role = (
            [
                "--head",
                f"--port={GCS_PORT}",
                "--include-dashboard=true",
                f"--dashboard-host={host.address}",
                f"--dashboard-port={DASHBOARD_PORT}",
            ]
            if host.index == 0
            else [f"--address={self.head.address}:{GCS_PORT}"]
        )
        cmd = [
            "ip", "netns", "exec", host.namespace, str(BIN / "ray"), "start", "--block", *role,
            f"--node-ip-address={host.address}", f"--num-cpus={self.cpus_per_host:g}", "--num-gpus=0",
            f"--temp-dir={host.temp_dir}", "--disable-usage-stats",
        ]  # fmt: skip
        env = {**self.env, "DISTRAIN_CACHE_DIR": host.cache_dir}
        host.ray = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.wait_for_nodes(sum(h.ray is not None and h.ray.poll() is None for h in self.hosts))

    def client(
        self, *cmd: str, timeout: float = 60, check: bool = True, address: str | None = None
    ) -> subprocess.CompletedProcess:
        """A command in the head's namespace (in the repository), with the bed's token and a Ray address:
        `address`, else the dashboard's (for `ray job`)."""
        env = {**self.env, "RAY_ADDRESS": address or self.dashboard, "DISTRAIN_CACHE_DIR": self.head.cache_dir}
        full = ["ip", "netns", "exec", self.head.namespace, *cmd]
        out = subprocess.run(full, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stdout[-2000:]}{out.stderr[-2000:]}")
        return out

    def train(self, overrides: list[str], timeout_s: float) -> str | None:
        """`python jobs/train.py <overrides>` as a driver on the head host, attached to the bed's cluster;
        None if it succeeded, else the end of its output."""
        try:
            done = self.client(
                sys.executable, "jobs/train.py", *overrides, timeout=timeout_s, check=False, address=self.gcs
            )
        except subprocess.TimeoutExpired:
            return f"did not finish within {timeout_s:g} s"
        return None if done.returncode == 0 else (done.stdout + done.stderr)[-2000:]

    @property
    def addresses(self) -> list[str]:
        return [h.address for h in self.hosts]

    @property
    def gcs(self) -> str:
        return f"{self.head.address}:{GCS_PORT}"

    def alive_nodes(self, until: int | None = None, timeout_s: float = 0) -> list[str]:
        """The addresses of the nodes the head counts alive; with `until`, once that many are (or timeout_s has
        passed), asked every 0.2 s from one client: a client's start (Python, Ray's import, a driver attached) is
        the cost of a look, seconds of CPU, which each look would otherwise take from the nodes starting."""
        script = (
            "import json, sys, time, ray\n"
            "ray.init()\n"
            "until, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])\n"
            "alive = lambda: [n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]\n"
            "while len(nodes := alive()) != until and time.monotonic() < deadline:\n"
            "    time.sleep(0.2)\n"
            "print(json.dumps(nodes))"
        )
        args = [str(-1 if until is None else until), f"{timeout_s:g}"]
        out = self.client(sys.executable, "-c", script, *args, check=False, address=self.gcs, timeout=timeout_s + 60)
        return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else []

    def wait_for_nodes(self, n: int, timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            for h in self.hosts:
                if h.ray is not None and h.ray.poll() is not None:
                    raise RuntimeError(f"ray start on host {h.index} ({h.address}) exited with {h.ray.returncode}")
            # Up to 10 s of looks from one client, then the `ray start` processes checked again.
            left = deadline - time.monotonic()
            if self.head.ray is not None and len(self.alive_nodes(until=n, timeout_s=max(0, min(10, left)))) == n:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{n} Ray nodes were not up within {timeout_s:g} s")
            time.sleep(0.5)

    def service_address(self) -> str:
        """An address on the bridge itself, reachable from every host, for a service the hosts share (an
        object store): processes run in the bridge's namespace (`bridge`) bind it."""
        address = f"{SUBNET}.254"
        if address not in self._in(self.bridge, "ip", "-o", "addr", "show", "br0"):
            self._in(self.bridge, "ip", "link", "set", "lo", "up")  # a namespace's own addresses route through lo
            self._in(self.bridge, "ip", "addr", "add", f"{address}/24", "dev", "br0")
        return address

    def kill_host(self, host: Host) -> None:
        """Every process of the host at once (raylet, workers, all): a machine that died."""
        kill_all_in(host.namespace)
        if host.ray is not None:
            host.ray.wait(timeout=10)
            host.ray = None

    def slow_link(self, delay_ms: float, rate_mbit: float) -> str:
        """Every packet between hosts crosses one bridge port's egress: delay and limit it there, with netem;
        on a kernel without netem (CONFIG_NET_SCH_NETEM unset), limit the rate alone with a token bucket.
        What was applied, in words."""
        shapes = [
            ("netem", "delay", f"{delay_ms:g}ms", "rate", f"{rate_mbit:g}mbit", "limit", "10000"),
            ("tbf", "rate", f"{rate_mbit:g}mbit", "burst", "32kb", "latency", "100ms"),
        ]
        for shape in shapes:
            try:
                for host in self.hosts:
                    self._in(self.bridge, "tc", "qdisc", "replace", "dev", self._port(host), "root", *shape)
            except RuntimeError as e:
                if "unknown" not in str(e):
                    raise
                continue
            if shape[0] == "netem":
                return f"{delay_ms:g} ms each way and {rate_mbit:g} Mbit/s (tc netem)"
            return f"{rate_mbit:g} Mbit/s (tc tbf; no delay: this kernel has no netem)"
        raise RuntimeError("neither tc netem nor tc tbf is available")

    def _port(self, host: Host) -> str:
        """The bridge's end of the host's veth pair."""
        return f"p{host.index}{self.tag[len(PREFIX) :]}"[:15]

    def close(self) -> None:
        """End every process in every namespace by PID, delete the namespaces (and with them the
        veths and the bridge) and the Ray temp dirs."""
        errors = []
        for host in self.hosts:
            try:
                kill_all_in(host.namespace)
            except RuntimeError as e:
                errors.append(str(e))
            if host.ray is not None:
                host.ray.wait(timeout=10)
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
            shutil.rmtree(host.temp_dir, ignore_errors=True)
        kill_all_in(self.bridge)
        subprocess.run(["ip", "netns", "del", self.bridge], capture_output=True)
        left = [n for n in sh("ip", "netns", "list").split() if n.startswith(self.tag)]
        if errors or left:
            raise RuntimeError(f"test bed not fully removed: {errors} {left}")
