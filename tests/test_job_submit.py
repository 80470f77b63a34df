"""`ray job submit` for real: a head node on loopback, our entrypoint submitted with a working dir."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY, free_port

RAY = str(Path(sys.executable).parent / "ray")


def pids_with_env(marker: str) -> list[int]:
    """Processes whose environment holds `marker`: Ray rewrites its workers' titles, but every
    process the head starts inherits the head's environment."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if marker.encode() in (proc / "environ").read_bytes().split(b"\0"):
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


@pytest.fixture(scope="module")
def ray_head():
    """`ray start --head --block` on 127.0.0.1 with its own temp dir and ports. Torn down by PID:
    the process group we started, then every process that inherited our marker variable (workers
    can outlive the head in sessions of their own). `ray stop` would also stop the tests' cluster."""
    temp_dir = tempfile.mkdtemp(prefix="rayh", dir="/tmp")  # short: Ray's socket paths are length-limited
    dashboard = free_port()
    marker = f"DISTRAIN_TEST_HEAD={temp_dir}"
    env = {
        **os.environ,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "DISTRAIN_TEST_HEAD": temp_dir,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    env.pop("RAY_ADDRESS", None)
    ports = {
        f"--{name}": str(free_port())
        for name in (
            "port",
            "node-manager-port",
            "object-manager-port",
            "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port",
            "runtime-env-agent-port",
            "metrics-export-port",
            "ray-client-server-port",
        )
    }
    cmd = [
        RAY,
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        "--num-cpus=2",
        "--num-gpus=0",  # CPU workers, whatever the machine has
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard}",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
        *[a for kv in ports.items() for a in kv],
    ]
    head = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"http://127.0.0.1:{dashboard}"
    client_env = {**env, "RAY_AUTH_MODE": "token", "RAY_ADDRESS": address}
    try:
        deadline = time.monotonic() + 90
        while subprocess.run([RAY, "job", "list"], env=client_env, capture_output=True).returncode != 0:
            assert head.poll() is None, "ray start --head exited"
            assert time.monotonic() < deadline, "the head's job server did not come up"
            time.sleep(1)
        yield client_env
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        for pid in pids_with_env(marker):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while pids_with_env(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not pids_with_env(marker), "processes of the test head survived SIGKILL"
        shutil.rmtree(temp_dir, ignore_errors=True)


def submit(env: dict, submission_id: str, *overrides: str) -> str:
    """Submit, wait for the end (the CLI follows the job), and return `ray job status`'s words."""
    subprocess.run(
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
    status = subprocess.run([RAY, "job", "status", submission_id], env=env, capture_output=True, text=True)
    return status.stdout + status.stderr


@pytest.mark.timeout(400)
def test_ray_job_submit_trains_and_reports_status(ray_head, tmp_path: Path):
    common = [*TINY, f"run.storage={tmp_path}", "cluster.num_workers=2"]
    out = submit(ray_head, "distrain-ok", *common, "run.name=submitted", "trainer.max_steps=8")
    assert "Job 'distrain-ok' succeeded" in out, out
    summary = json.loads((tmp_path / "submitted" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_step"] == 8
    assert any((tmp_path / "submitted" / "hydra").glob("*/.hydra/config.yaml"))  # Hydra's record kept

    out = submit(ray_head, "distrain-bad", *common, "run.name=bad", "trainer.global_batch_size=7")
    assert "Job 'distrain-bad' failed" in out, out
    logs = subprocess.run([RAY, "job", "logs", "distrain-bad"], env=ray_head, capture_output=True, text=True)
    assert "trainer.global_batch_size=7" in logs.stdout


@pytest.mark.timeout(400)
def test_ray_job_stop_checkpoints_before_the_job_ends(ray_head, tmp_path: Path):
    """`ray job stop` sends the driver SIGTERM, and SIGKILL RAY_JOB_STOP_WAIT_TIME_S later: in
    between, every rank stops at one step and a checkpoint is committed."""
    run_dir = tmp_path / "stopped"
    overrides = [*TINY, f"run.storage={tmp_path}", "run.name=stopped", "trainer.max_steps=5000"]
    wait = json.dumps({"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "60"}})
    subprocess.run(
        [RAY, "job", "submit", "--no-wait", "--submission-id=distrain-stop", f"--working-dir={REPO}"]
        + [f"--runtime-env-json={wait}", "--", "python", "jobs/train.py", *overrides],
        env=ray_head,
        check=True,
        capture_output=True,
        timeout=120,
    )
    deadline = time.monotonic() + 240
    while not (run_dir / "metrics.jsonl").exists() or len((run_dir / "metrics.jsonl").read_text().splitlines()) < 5:
        assert time.monotonic() < deadline, "the job did not start training"
        time.sleep(0.5)
    subprocess.run([RAY, "job", "stop", "distrain-stop"], env=ray_head, capture_output=True, timeout=120)
    status = subprocess.run([RAY, "job", "status", "distrain-stop"], env=ray_head, capture_output=True, text=True)
    assert "Job 'distrain-stop' was stopped" in status.stdout + status.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "stopped" and 5 <= summary["final_step"] < 5000
    step = summary["final_step"]
    assert (run_dir / "checkpoints" / f"step_{step:08d}" / "COMMITTED").exists()
