"""Rank 0's record of a run: metrics.jsonl, summary.json, Weights & Biases and TensorBoard."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from distrain.config import TrainConfig
from distrain.model.size import flops_per_token, num_params
from distrain.storage.checkpoint import COMMIT_MARKER, checkpoints
from distrain.storage.fsutil import atomic_write, write_json
from distrain.storage.record_sync import RecordSync

METRICS_FILE = "metrics.jsonl"
SUPERSEDED_FILE = "metrics.superseded.jsonl"
SUMMARY_FILE = "summary.json"
TENSORBOARD_DIR = "tensorboard"


def wandb_mode(mode: str | None) -> str:
    """The configured mode, else WANDB_MODE, else online only with an API key at hand: offline
    needs no account or network. Decided in the driver, whose environment is the user's."""
    return mode or os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")


# Rank 0's files of the run record: on an object store, uploaded by rank 0 (storage/record_sync.py), whose node's
# mirror alone has them
TRACKER_FILES = (METRICS_FILE, SUPERSEDED_FILE, TENSORBOARD_DIR, "wandb")


class Tracker:
    """`record`: a run on an object store: the files above are pulled into a fresh mirror before they are
    opened, and uploaded every storage.sync_interval_s (on a thread: no step waits) and at `close`."""

    def __init__(
        self, run_dir: str, config: dict, resume_step: int, wandb_run_id: str | None, record: RecordSync | None = None
    ):
        self.run_dir = Path(run_dir)
        self.record, self.sync_interval_s = record, config["storage"]["sync_interval_s"]
        if record is not None:
            record.try_pull(_say)  # a rank 0 on a node new to the run appends to the run's metrics, not to nothing
        self.metrics_path = self.run_dir / METRICS_FILE
        _set_aside_lines_after(self.metrics_path, resume_step)
        self._metrics = open(self.metrics_path, "a")
        self.tensorboard = None
        if config["logger"]["tensorboard"]:  # checked installed by the driver (validation)
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard drops what an earlier attempt logged past the checkpoint, as metrics.jsonl does
            self.tensorboard = SummaryWriter(
                str(self.run_dir / TENSORBOARD_DIR), purge_step=resume_step + 1 if resume_step else None, flush_secs=10
            )
        self.wandb_run = None
        self.artifacts = False  # logger.wandb.log_checkpoints
        self.checkpoints_logged: set[str] = set()
        wb = config["logger"]["wandb"]
        mode = wb["mode"]  # resolved by the driver (wandb_mode)
        if mode != "disabled":
            import wandb

            # A rank 0 that survived a failure (a recovery from replicas, a restart that kept it) goes on with its
            # run: wandb.init would return it anyway, but only after making a second, empty offline-run folder.
            kept = wandb.run if wandb.run is not None and wandb.run.id == wandb_run_id else None
            self.wandb_run = kept or wandb.init(
                project=wb["project"],
                entity=wb["entity"],
                name=config["run"]["name"],
                id=wandb_run_id,
                resume="allow",
                dir=str(self.run_dir),
                mode=mode,
                config=config,
                settings=wandb.Settings(console="off", silent=True),
            )
            self.artifacts = wb["log_checkpoints"]
            self.checkpoints_logged = {p.name for p in committed(self.run_dir)}  # earlier invocations logged theirs

    @property
    def wandb_run_id(self) -> str | None:
        return self.wandb_run.id if self.wandb_run is not None else None

    def log(self, step: int, metrics: dict) -> None:
        record = {"step": step, "time": time.time(), **metrics}  # time: for loss against wall-clock
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()
        if self.tensorboard is not None:
            for key, value in metrics.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    self.tensorboard.add_scalar(key, value, step, walltime=record["time"])
        if self.wandb_run is not None:
            self.log_checkpoints()
            self.wandb_run.log(metrics, step=step)
        if self.record is not None:
            self.record.sync_due(self.sync_interval_s, _say)

    def log_checkpoints(self) -> None:
        """With logger.wandb.log_checkpoints, each checkpoint committed since the last look as a W&B artifact:
        a reference to its directory on the run's storage, on an object store its URL there, never a node's mirror
        (no copy, no checksum read of its files)."""
        if not self.artifacts:
            return
        import wandb

        for path in reversed(committed(self.run_dir)):
            if path.name in self.checkpoints_logged:
                continue
            step = int(path.name.removeprefix("step_"))
            artifact = wandb.Artifact(
                re.sub(r"[^\w.-]", "_", f"{self.wandb_run.name}-checkpoint"), type="model", metadata={"step": step}
            )
            if self.record is None:
                artifact.add_reference(path.resolve().as_uri(), name=path.name, checksum=False)
            else:
                refer_to(artifact, f"{self.record.store.url}/{path.parent.name}/{path.name}", path.name)
            self.wandb_run.log_artifact(artifact, aliases=[path.name, "latest"])
            self.checkpoints_logged.add(path.name)

    def close(self, summary: dict) -> None:
        self._metrics.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb_run is not None:
            self.log_checkpoints()
            self.wandb_run.summary.update(summary)
            self.wandb_run.finish()
            import wandb

            # End W&B's service now: left to its atexit hook, the teardown races the service's own end when
            # Ray kills a finished job's workers, and prints a traceback into the job's log.
            wandb.teardown()
        if self.record is not None:
            self.record.stop()
            self.record.try_sync(_say)


def refer_to(artifact: Any, url: str, name: str) -> None:
    """A reference to `url` in the artifact, as W&B's own handler for its scheme records one without a checksum (the
    URL, its path and digest): what artifact.add_reference does, without the handler's client library (boto3 for
    s3://) that only a checksum or a download uses, and without a request to the store."""
    from wandb.sdk.artifacts.artifact_manifest_entry import ArtifactManifestEntry

    artifact.manifest.add_entry(ArtifactManifestEntry(path=name, ref=url, digest=url))


def _say(text: str) -> None:
    print(f"distrain: {text}", flush=True)


def committed(run_dir: Path) -> list[Path]:
    """The run's committed checkpoints, newest first."""
    return [p for p in checkpoints(run_dir / "checkpoints") if (p / COMMIT_MARKER).exists()]


def _set_aside_lines_after(path: Path, step: int) -> None:
    """A resumed run repeats the steps after its checkpoint; the earlier attempt's lines for those
    steps move to metrics.superseded.jsonl (kept, not lost) so metrics.jsonl has each step once."""
    if not path.exists():
        return
    kept, superseded = [], []
    for line in path.read_text().splitlines(keepends=True):
        try:
            (kept if json.loads(line)["step"] <= step else superseded).append(line)
        except (ValueError, KeyError):
            superseded.append(line)  # a line torn by a crash mid-write
    if superseded:
        with open(path.with_name(SUPERSEDED_FILE), "a") as f:
            f.writelines(superseded)
        atomic_write(path, "".join(kept))


def run_results(
    cfg: TrainConfig,
    final_step: int,
    final_loss: float | None,
    final_val_loss: float | None,
    first_step_s: float | None,
    train_s: float,
    world_size: int,
    wandb_run_id: str | None,
    stopped: bool,
) -> dict:
    """What a finished attempt reports, whichever engine trained it (summary.json takes it in)."""
    return {
        "final_step": final_step,
        "final_loss": final_loss,
        "final_val_loss": final_val_loss,
        "first_step_s": first_step_s,
        "train_s": train_s,
        "world_size": world_size,
        "num_params": num_params(cfg.model, cfg.trainer.seq_len),
        "flops_per_token": flops_per_token(cfg.model, cfg.trainer.seq_len),
        "wandb_run_id": wandb_run_id,
        "stopped": stopped,
    }


def write_summary(run_dir: str, summary: dict) -> None:
    """summary.json, with the distrain version that trained the run (an installed command and a checkout can differ)."""
    from distrain import __version__

    write_json(Path(run_dir) / SUMMARY_FILE, {**summary, "distrain_version": __version__})


def read_metrics(run_dir: str) -> list[dict]:
    """The run's metrics lines, without a last one torn by a crash mid-write (the resume sets it aside)."""
    path = Path(run_dir) / METRICS_FILE
    return parse_metrics(path.read_text() if path.exists() else "")


def parse_metrics(text: str) -> list[dict]:
    """The lines of a metrics.jsonl, read wherever it is; a line torn by a crash mid-write left out."""
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records
