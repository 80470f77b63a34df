"""W&B offline, as `wandb sync` uploads it later: the run's .wandb files hold the resolved config, every
metric, the summary and (opt-in) each committed checkpoint as a reference artifact; a resumed run
writes the same run id again, and its history carries on where the last invocation stopped; a rank 0 that
survives a failure goes on with its run."""

from __future__ import annotations

import importlib.util
import json
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest
from conftest import REPO, make_config

from distrain.config import recorded
from distrain.driver.launch import train
from distrain.storage.record_sync import record_sync
from distrain.storage.tracking import TRACKER_FILES, Tracker, read_metrics

BLOCK, HEADER = 32768, 7  # the .wandb file: a LevelDB-style log of protobuf Records in 32 KiB blocks
FULL, LAST = 1, 4


def wandb_records(path: Path) -> Iterator:
    """The Records of a .wandb file, in order: each a protobuf of wandb's own schema."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, pieces = HEADER, b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0:
            pos += BLOCK - pos % BLOCK
            continue
        pieces += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def of_type(records: list, kind: str) -> list:
    return [getattr(r, kind) for r in records if r.WhichOneof("record_type") == kind]


@pytest.mark.timeout(300)
def test_offline_run_is_complete_and_one_run_across_a_resume(tracked_run):
    run_dir, first, second = tracked_run
    assert first["wandb_run_id"] == second["wandb_run_id"]

    folders = sorted((run_dir / "wandb").glob("offline-run-*"))  # one per invocation; `wandb sync` takes both
    assert len(folders) == 2
    records = [list(wandb_records(next(folder.glob("*.wandb")))) for folder in folders]

    for invocation, summary in zip(records, (first, second), strict=True):
        (run,) = of_type(invocation, "run")
        assert run.run_id == second["wandb_run_id"]
        config = {item.key: json.loads(item.value_json) for item in run.config.update}
        assert config["optim"]["lr"] == 0.002 and config["run"]["name"] == "w"  # resolved, as trained
        final = {item.key: json.loads(item.value_json) for s in of_type(invocation, "summary") for item in s.update}
        assert final["final_step"] == summary["final_step"] and final["stopped"] is False

    # One history, continuous across the invocations, holding what metrics.jsonl holds.
    history = [
        (h.step.num, {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in h.item})
        for invocation in records
        for h in of_type(invocation, "history")
    ]
    assert [step for step, _ in history] == list(range(1, 7))
    logged = read_metrics(str(run_dir))
    for (step, values), line in zip(history, logged, strict=True):
        assert step == line["step"] and values["loss"] == pytest.approx(line["loss"]) and "lr" in values

    # Each committed checkpoint once, as a reference to its directory (no copy).
    artifacts = [a for rs in records for a in of_type(rs, "artifact")]
    assert [json.loads(a.metadata)["step"] for a in artifacts] == [2, 4, 6]
    for artifact in artifacts:
        assert artifact.type == "model" and artifact.name == "w-checkpoint"
        step_dir = run_dir / "checkpoints" / f"step_{json.loads(artifact.metadata)['step']:08d}"
        refs = {entry.ref for entry in artifact.manifest.contents}  # its files, by reference (no checksum read)
        assert refs and all(ref.startswith(f"{step_dir.resolve().as_uri()}/") for ref in refs)
    kept = run_dir / "checkpoints" / "step_00000006"  # (checkpoint.keep=2 pruned step 2's directory)
    assert refs == {f"{kept.resolve().as_uri()}/{p.name}" for p in kept.iterdir()}


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("ray_cluster")
def test_a_recovery_from_replicas_keeps_one_wandb_run_and_ray_says_nothing(tmp_path: Path, capfd):
    """Rank 1 is killed after step 3 and rank 0, which survives, hands its replica to the spare that takes rank 1:
    rank 0's W&B run goes on, in its one offline-run folder with every step once (wandb.init in the same process
    made a second folder, empty, and returned the same run). The console says the death in distrain's one line,
    without Ray's paragraph on the OOM killer and SIGSEGV."""
    kill = ["fault.kill_at_step=3", "fault.kill_rank=1", "cluster.spares=1", "cluster.restart_backoff_s=0"]
    cfg = make_config(tmp_path, "run.name=r", "logger.wandb.mode=offline", "trainer.max_steps=6", *kill)
    summary = train(cfg)
    assert summary["restarts"] == 1 and summary["attempts"][1]["info"]["resumed_from"] == "replicas"
    (folder,) = (Path(cfg.run_dir) / "wandb").glob("offline-run-*")
    records = list(wandb_records(next(folder.glob("*.wandb"))))
    assert [h.step.num for h in of_type(records, "history")] == list(range(1, 7))
    assert [run.run_id for run in of_type(records, "run")] == [summary["wandb_run_id"]]
    said = "".join(capfd.readouterr())
    assert "rank 1 (pid" in said and "; recovering (failure 1 of 3)" in said, said
    assert "A worker died or was killed" not in said and "(raylet)" not in said, said


AT_EXIT = """
import os, signal, sys
from dataclasses import asdict
from pathlib import Path
sys.path.insert(0, "tests")
from conftest import make_config
from distrain.storage.tracking import Tracker
cfg = make_config(Path(sys.argv[1]), "logger.wandb.mode=offline", "run.name=t")
Path(cfg.run_dir).mkdir()
tracker = Tracker(cfg.run_dir, asdict(cfg), 0, None)
tracker.log(1, {"loss": 1.0})
tracker.close({"final_step": 1})
for stat in Path("/proc").glob("[0-9]*/stat"):  # as Ray ends a finished job's worker: its children first
    if stat.read_text().rpartition(")")[2].split()[1] == str(os.getpid()):
        os.kill(int(stat.parent.name), signal.SIGKILL)
"""


def test_a_closed_run_leaves_wandb_nothing_to_do_at_exit(tmp_path: Path):
    """W&B's atexit hook tears its service down; when Ray has killed the service first (a submitted job's
    worker as the job ends), the hook printed a traceback into the job's log. Closing ends the service."""
    done = subprocess.run([sys.executable, "-c", AT_EXIT, str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


def test_a_run_on_an_object_store_references_its_checkpoints_there(s3, tmp_path: Path):
    """logger.wandb.log_checkpoints with run.storage=s3://…: the artifact of a committed checkpoint references its
    URL on the store, the durable copy, not the node's mirror (file://); recorded without boto3, which wandb's S3
    handler would import to make a client it never uses for a reference without a checksum (not installed here)."""
    assert importlib.util.find_spec("boto3") is None
    cfg = make_config(s3.url("wandb"), "run.name=w", f"storage.cache_dir={tmp_path}", "logger.wandb.mode=offline")
    cfg.logger.wandb.log_checkpoints = True
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True)
    tracker = Tracker(str(run_dir), recorded(asdict(cfg)), 0, None, record_sync(cfg, run_dir, TRACKER_FILES))
    committed = run_dir / "checkpoints" / "step_00000002"
    committed.mkdir(parents=True)
    (committed / "COMMITTED").write_text("{}")  # the mirror's marker, written once the store's was
    tracker.close({})  # logs the checkpoints committed since it looked
    (folder,) = (run_dir / "wandb").glob("offline-run-*")
    (artifact,) = of_type(list(wandb_records(next(folder.glob("*.wandb")))), "artifact")
    entries = [(entry.path, entry.ref) for entry in artifact.manifest.contents]
    assert entries == [("step_00000002", f"{cfg.run_url}/checkpoints/step_00000002")]
