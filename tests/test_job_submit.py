"""`ray job submit` for real: a head node on loopback, our entrypoint submitted with a working dir."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import REPO, TINY, bash, documented

from distrain.commands.cluster import processes  # noqa: E402  (jobs/cluster.py)

RAY = str(Path(sys.executable).parent / "ray")
RAY_DEFAULT_PORTS = (6379, 8265, 52365)  # GCS, dashboard, dashboard agent: held by "another cluster" here


def documented_commands() -> list[str]:
    """The commands of docs/cluster.md's one-machine block, as printed (comments and all)."""
    return documented("cluster.md", "One machine")


@pytest.fixture(scope="module")
def ray_head():
    """The head docs/cluster.md's first command starts, stopped by its last one; yields the environment
    the first one exports. Every process the head starts inherits our marker variable: what the documented
    stop leaves is an error, and is ended by PID (`ray stop` would also stop the tests' cluster)."""
    if not (REPO / ".venv" / "bin" / "ray").exists():
        pytest.skip("the documented commands use the .venv that `make setup` makes")
    first, *_, last = documented_commands()
    marker = f"DISTRAIN_TEST_HEAD={uuid.uuid4().hex}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # a user's shell: no loopback switch
    env[marker.partition("=")[0]] = marker.partition("=")[2]
    exported, stopped = {}, None
    try:
        with contextlib.ExitStack() as held:
            for port in RAY_DEFAULT_PORTS:
                with contextlib.suppress(OSError):  # taken already: by another cluster, as on the host
                    held.enter_context(socket.create_server(("127.0.0.1", port)))
            started = bash(f"{first}\nenv -0", env, timeout=120)
        exported = dict(kv.partition("=")[::2] for kv in started.stdout.split("\0") if kv.startswith("RAY_"))
        assert started.returncode == 0 and exported.get("RAY_API_SERVER_ADDRESS"), started.stderr
        assert processes(marker), "the head started no process"
        yield {**env, **exported}
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            stopped = bash(last, {**env, **exported}, timeout=60)
        left = processes(marker)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        if "RAY_ADDRESS" in exported:  # its temp dir, which the documented stop removes
            shutil.rmtree(f"/tmp/distrain-ray-{exported['RAY_ADDRESS'].rpartition(':')[2]}", ignore_errors=True)
    assert stopped and stopped.returncode == 0 and not left, (stopped, left)


def listening(pids: list[int]) -> set[str]:
    """The addresses the processes `pids` accept TCP connections on (/proc/net/tcp*: LISTEN sockets,
    by inode)."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    inodes.add(os.readlink(fd).removeprefix("socket:[").removesuffix("]"))
    addresses = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            local, state, inode = (line.split()[i] for i in (1, 3, 9))
            if state == "0A" and inode in inodes:
                raw = bytes.fromhex(local.partition(":")[0])
                host = ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))
                addresses.add(str(getattr(host, "ipv4_mapped", None) or host))  # in 32-bit host-order words
    return addresses


def lacking(pids: list[int], marker: str, entry: str) -> list[str]:
    """Those of `pids` that are still the head's (their environment holds `marker`, read together with the
    entry) and whose environment lacks `entry`, with their command lines. A process listed earlier may have
    ended since, and its PID gone to another process (the head starts and ends short-lived workers). A process
    Ray retitled (`ray::…`, padded with spaces) has its title written over the start of its environment's
    memory, which /proc then shows: its environment cannot be read, only its parent's (checked here)."""
    found = []
    for pid in pids:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except OSError:
            continue
        if cmdline.startswith("ray::"):
            continue
        if marker.encode() in environ and entry.encode() not in environ:
            found.append(f"{pid} {cmdline!r}")
    return found


def test_the_documented_one_machine_commands_run_as_printed(ray_head):
    """docs/cluster.md's submission, on the head its start command started (loopback only, though Ray's
    default ports are taken): the job trains, keeps Hydra's record and says it succeeded."""
    marker = f"DISTRAIN_CLUSTER=/tmp/distrain-ray-{ray_head['RAY_ADDRESS'].rpartition(':')[2]}"
    head = processes(marker)
    assert listening(head) == {"127.0.0.1"}, "the head listens beyond loopback"
    assert lacking(head, marker, "RAY_USAGE_STATS_ENABLED=0") == [], "the head reports usage statistics"
    assert lacking(head, marker, "RAY_JOB_STOP_WAIT_TIME_S=60") == [], "`ray job stop` kills a job 3 s after"
    out = bash(documented_commands()[1], ray_head, timeout=300)
    said = out.stdout + out.stderr
    run_dir = re.search(r"run directory (\S+)", said)
    try:
        assert out.returncode == 0 and run_dir and re.search(r"Job 'raysubmit_\w+' succeeded", said), said
        summary = json.loads((Path(run_dir[1]) / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["final_step"] == 3
        assert any((Path(run_dir[1]) / "hydra").glob("*/.hydra/config.yaml"))  # Hydra's record kept
    finally:
        if run_dir and Path(run_dir[1]).parent == REPO / "runs":
            shutil.rmtree(run_dir[1])


def submit(env: dict, submission_id: str, *overrides: str) -> str:
    """Submit and wait for the end: what the CLI said, following the job (its log, then how it ended in `ray job
    status`'s words: the CLI asks the same once the log ends)."""
    out = subprocess.run(
        [
            RAY,
            "job",
            "submit",
            f"--submission-id={submission_id}",
            f"--working-dir={REPO}",
            "--",
            "python",
            "jobs/train.py",
            *overrides,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return out.stdout + out.stderr


@pytest.mark.timeout(400)
def test_a_failing_job_reports_failed(ray_head, tmp_path: Path):
    common = [*TINY, f"run.storage={tmp_path}", "cluster.num_workers=2"]
    out = submit(ray_head, "distrain-bad", *common, "run.name=bad", "trainer.global_batch_size=7")
    assert "Job 'distrain-bad' failed" in out, out
    assert "trainer.global_batch_size=7" in out.split("Job 'distrain-bad' failed")[0]  # in the job's log


@pytest.mark.timeout(400)
def test_ray_job_stop_checkpoints_before_the_job_ends(ray_head, tmp_path: Path):
    """`ray job stop` sends the driver SIGTERM, and SIGKILL RAY_JOB_STOP_WAIT_TIME_S later: in
    between, every rank stops at one step and a checkpoint is committed."""
    run_dir = tmp_path / "stopped"
    overrides = [*TINY, f"run.storage={tmp_path}", "run.name=stopped", "trainer.max_steps=5000"]
    subprocess.run(  # the documented cluster gives a stopped job RAY_JOB_STOP_WAIT_TIME_S=60 to checkpoint
        [RAY, "job", "submit", "--no-wait", "--submission-id=distrain-stop", f"--working-dir={REPO}"]
        + ["--", "python", "jobs/train.py", *overrides],
        env=ray_head,
        check=True,
        capture_output=True,
        timeout=120,
    )
    deadline = time.monotonic() + 240
    while not (run_dir / "metrics.jsonl").exists() or len((run_dir / "metrics.jsonl").read_text().splitlines()) < 5:
        assert time.monotonic() < deadline, "the job did not start training"
        time.sleep(0.5)
    # `ray job stop` waits for the job's end and says how it ended, in `ray job status`'s words.
    stop = subprocess.run(
        [RAY, "job", "stop", "distrain-stop"], env=ray_head, capture_output=True, text=True, timeout=120
    )
    said = stop.stdout + stop.stderr
    assert "Job 'distrain-stop' was stopped" in said, said
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "stopped" and 5 <= summary["final_step"] < 5000
    step = summary["final_step"]
    assert (run_dir / "checkpoints" / f"step_{step:08d}" / "COMMITTED").exists()
