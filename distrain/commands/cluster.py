"""A Ray cluster of one machine, on loopback, for `ray job submit` (docs/cluster.md):

    eval "$(distrain cluster start [ray start options])"   # sets RAY_ADDRESS & co.
    eval "$(distrain cluster stop)"                        # this cluster only
    (a checkout: eval "$(.venv/bin/python jobs/cluster.py start)", and stop)

A plain `ray start --head --node-ip-address=127.0.0.1` binds the machine's external address (Ray
rewrites loopback unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0), reports usage statistics, and takes
fixed ports that another cluster on the host may hold (its dashboard agent's, and `ray job submit`
then fails with "No available agent"). Here every port is a free one, and the cluster is known by its
GCS port: its temp dir is /tmp/distrain-ray-<port>, and every process it starts carries that path in
DISTRAIN_CLUSTER, so `stop` ends exactly those processes (`ray stop` ends every cluster on the host).
The variables go to stdout for `eval`; what happened, to stderr."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from distrain.commands import helped, how
from distrain.ports import free_ports

RAY = str(Path(sys.executable).parent / "ray")
MARKER = "DISTRAIN_CLUSTER"
PORTS = (  # every port `ray start --head` would otherwise take at a fixed default
    "dashboard-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "runtime-env-agent-port",
    "metrics-export-port",
    "node-manager-port",
    "object-manager-port",
    "ray-client-server-port",
)
LAST = ("raylet", "gcs_server")  # `ray stop`'s order: the raylet first, the rest, the GCS last
JOB_STOP_WAIT_S = 60
VARIABLES = ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_MODE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")


def temp_dir(gcs_port: int) -> Path:
    return Path(f"/tmp/distrain-ray-{gcs_port}")  # short: Ray's socket paths are length-limited


def processes(marker: str) -> list[int]:
    """This user's processes whose environment holds `marker` (Ray retitles its workers; the
    environment they inherit from the head stays)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if marker.encode() in (proc / "environ").read_bytes().split(b"\0"):
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


def end(directory: Path) -> int:
    """End every process of the cluster whose temp dir is `directory`, in `ray stop`'s order (the raylet
    first, the GCS last), each SIGTERM then SIGKILL after 5 s; remove the directory. The number ended."""
    marker = f"{MARKER}={directory}"
    pids = processes(marker)
    for bucket in ("raylet", None, "gcs_server"):
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            left = [p for p in processes(marker) if command(p) == bucket or bucket is None and command(p) not in LAST]
            for pid in left:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while left and time.monotonic() < deadline:
                time.sleep(0.1)
                left = [p for p in left if alive(p)]
    shutil.rmtree(directory, ignore_errors=True)
    return len(pids)


def alive(pid: int) -> bool:
    """Running: not gone, and not a zombie that nobody has reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def start(ray_args: list[str]) -> int:
    gcs, *others = free_ports(1 + len(PORTS))
    directory = temp_dir(gcs)
    end(directory)  # a crashed cluster's leftovers under the same port
    ports = dict(zip(PORTS, others, strict=True))
    env = {**os.environ, MARKER: str(directory), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # the job's `python` is this one
    env.pop("RAY_ADDRESS", None)
    # `ray job stop` sends SIGTERM, then SIGKILL this long after (Ray's default, 3 s, is shorter than a
    # checkpoint often takes); the job's driver reads it too, as its deadline to checkpoint and stop.
    env.setdefault("RAY_JOB_STOP_WAIT_TIME_S", str(JOB_STOP_WAIT_S))
    cmd = [RAY, "start", "--head", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1", f"--port={gcs}"]
    cmd += [f"--{name}={port}" for name, port in ports.items()]
    cmd += [f"--temp-dir={directory}", "--disable-usage-stats", *ray_args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        end(directory)
        print(done.stdout + done.stderr, file=sys.stderr)
        print(f"distrain: error: `ray start` failed (exit status {done.returncode}), see above", file=sys.stderr)
        return 1
    dashboard = f"http://127.0.0.1:{ports['dashboard-port']}"
    print(
        f"distrain: Ray head on 127.0.0.1:{gcs}, dashboard {dashboard}, temp dir {directory}; "
        f'stop it with: eval "$({how("cluster")} stop)" (`ray stop` would stop every Ray '
        "cluster on this host)",
        file=sys.stderr,
    )
    values = (f"127.0.0.1:{gcs}", dashboard, "token", "0")
    print("export " + " ".join(f"{k}={v}" for k, v in zip(VARIABLES, values, strict=True)))
    return 0


def stop(address: str | None) -> int:
    if not address:
        print(
            "distrain: error: no cluster to stop: give its address (127.0.0.1:PORT) or set RAY_ADDRESS", file=sys.stderr
        )
        return 2
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if host != "127.0.0.1" or not port.isdigit() or not temp_dir(int(port)).is_dir():
        print(f"distrain: error: {address} is not a cluster `{how('cluster')} start` started", file=sys.stderr)
        return 2
    count = end(temp_dir(int(port)))
    print(f"distrain: stopped the Ray cluster at {address} ({count} processes)", file=sys.stderr)
    print("unset " + " ".join(VARIABLES))
    return 0


def main(argv: list[str]) -> int:
    if helped(argv, __doc__):
        return 0
    if argv[:1] == ["start"]:
        return start(argv[1:])
    if argv[:1] == ["stop"] and len(argv) <= 2:
        return stop(argv[1] if len(argv) == 2 else os.environ.get("RAY_ADDRESS"))
    print(f"usage: {how('cluster')} start [ray start options] | stop [127.0.0.1:PORT]", file=sys.stderr)
    return 2
