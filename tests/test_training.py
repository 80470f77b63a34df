"""End-to-end training through Ray: parity across layouts, exact resume, torn checkpoints."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from conftest import DAMAGES, damage, final_weights, logged, make_config

from distrain.driver.launch import train
from distrain.storage.checkpoint import COMMIT_MARKER, step_dir

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_ddp_parity_across_workers_and_accumulation(tmp_path: Path):
    """Global batch 8: 4 workers × 1 micro-batch of 2, 2 workers × 2, 1 worker × 4 are one training.
    Losses, gradient norms (before clipping: they catch a wrong accumulation scale, which AdamW's
    updates would hide) and final weights agree within 1e-5 in fp32; only summation order differs."""
    runs = {}
    for workers in (4, 2, 1):
        cfg = make_config(tmp_path, f"run.name=w{workers}", f"cluster.num_workers={workers}", "trainer.max_steps=20")
        summary = train(cfg)
        assert summary["world_size"] == workers
        runs[workers] = cfg
    reference = logged(runs[1])
    assert sorted(reference) == list(range(1, 21))
    for workers in (4, 2):
        for key in ("loss", "grad_norm"):
            want, got = logged(runs[1], key), logged(runs[workers], key)
            for step in reference:
                assert got[step] == pytest.approx(want[step], abs=1e-5, rel=1e-5), f"{workers} workers, {key} {step}"
        ref_w, got_w = final_weights(runs[1]), final_weights(runs[workers])
        for name, tensor in ref_w.items():
            torch.testing.assert_close(got_w[name], tensor, atol=1e-5, rtol=0, msg=f"{workers} workers: {name}")
    assert reference[20] < reference[1] - 0.5  # and it did learn something


def test_resume_is_exact(tmp_path: Path):
    """20 steps in one go == 10 steps, then the same run.name rerun to 20: bitwise weights and
    identical logged losses. The W&B run (offline) is the same run across both invocations."""
    common = ["trainer.max_steps=20", "optim.decay_steps=20", "cluster.num_workers=2"]
    straight = make_config(tmp_path, "run.name=straight", *common)
    train(straight)

    # The checkpoint resumed from is written in the foreground, the others in the background (the default).
    first = make_config(
        tmp_path,
        "run.name=resumed",
        *common,
        "trainer.max_steps=10",
        "logger.wandb.mode=offline",
        "checkpoint.async=false",
    )
    first_summary = train(first)
    assert first_summary["final_step"] == 10
    second = make_config(tmp_path, "run.name=resumed", *common, "logger.wandb.mode=offline")
    second_summary = train(second)
    assert second_summary["resumed_from"].endswith("step_00000010")
    assert second_summary["final_step"] == 20
    assert len(second_summary["history"]) == 1  # the first invocation's summary is kept

    assert logged(second) == logged(straight)  # exact float equality, every step 1..20
    a, b = final_weights(straight), final_weights(second)
    for name in a:
        assert torch.equal(a[name], b[name]), name

    assert first_summary["wandb_run_id"] and first_summary["wandb_run_id"] == second_summary["wandb_run_id"]
    assert any((Path(second.run_dir) / "wandb").glob(f"offline-run-*-{first_summary['wandb_run_id']}"))


@pytest.mark.parametrize("kind", ["no_marker", "tensor_bytes"])
def test_torn_or_damaged_checkpoint_falls_back_to_previous(tmp_path: Path, capsys, kind: str):
    """A newest checkpoint without its commit marker, or with tensor bytes overwritten after its commit
    (size unchanged: tests/test_damage.py has every other damage), is skipped with one line; the 2-worker
    run resumes from the previous committed one and then finishes normally, its loss finite."""
    common = ["run.name=torn", "checkpoint.interval=5", "checkpoint.keep=3", "optim.decay_steps=12"]
    cfg = make_config(tmp_path, *common, "trainer.max_steps=10")
    train(cfg)
    newest = step_dir(Path(cfg.run_dir) / "checkpoints", 10)
    if kind == "no_marker":
        os.remove(newest / COMMIT_MARKER)
    else:
        damage(newest, kind)

    resumed = make_config(tmp_path, *common, "trainer.max_steps=12")
    capsys.readouterr()
    summary = train(resumed)
    said = [line for line in capsys.readouterr().err.splitlines() if "step_00000010" in line]
    assert len(said) == 1 and (kind == "no_marker" or DAMAGES[kind] in said[0]), said
    assert summary["resumed_from"].endswith("step_00000005")
    assert summary["final_step"] == 12 and summary["status"] == "completed"
    assert all(math.isfinite(loss) for loss in logged(resumed).values())
    # Steps 6..10 were trained again from step 5 and replace the earlier lines, which are kept aside.
    assert sorted(logged(resumed)) == list(range(1, 13))
    superseded = (Path(cfg.run_dir) / "metrics.superseded.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in superseded] == [6, 7, 8, 9, 10]


def test_resume_on_a_different_number_of_workers(tmp_path: Path):
    """A checkpoint from 2 workers resumes on 4 (DCP reshards on load); the global batch is the
    same sequences, so the run continues as the 20-step run on 1 worker does, within 1e-5."""
    common = ["trainer.max_steps=20", "optim.decay_steps=20"]
    straight = make_config(tmp_path, "run.name=one", "cluster.num_workers=1", *common)
    train(straight)
    train(make_config(tmp_path, "run.name=grow", "cluster.num_workers=2", *common, "trainer.max_steps=10"))
    grown = make_config(tmp_path, "run.name=grow", "cluster.num_workers=4", *common)
    summary = train(grown)
    assert summary["world_size"] == 4 and summary["resumed_from"].endswith("step_00000010")
    want, got = logged(straight), logged(grown)
    assert sorted(got) == list(range(1, 21))
    for step in want:
        assert got[step] == pytest.approx(want[step], abs=1e-5), step


def test_a_checkpoint_commits_after_its_steps_metrics_line(tmp_path: Path):
    """Metrics lines come a step late, but a run resumed from checkpoint k starts at step k + 1: line k
    must be written before checkpoint k can be loaded. Rank 0 straggles (each step ×30) so a background
    commit lands well inside the next step, when a lagged line k would still be unwritten."""
    cfg = make_config(
        tmp_path,
        "cluster.num_workers=1",
        "trainer.max_steps=5",
        "checkpoint.interval=2",
        "checkpoint.keep=5",
        "fault.straggler=0",
        "fault.straggler_slowdown=30",
    )
    train(cfg)
    written = {m["step"]: m["time"] for m in map(json.loads, (Path(cfg.run_dir) / "metrics.jsonl").open())}
    for step in (2, 4, 5):
        committed = (step_dir(Path(cfg.run_dir) / "checkpoints", step) / COMMIT_MARKER).stat().st_mtime
        assert written[step] <= committed, step


@pytest.mark.parametrize("interval", [1, 0], ids=["saving every step", "never saving"])
def test_a_non_finite_loss_ends_the_run_before_it_is_saved(tmp_path: Path, interval: int):
    """optim.lr=1e30 overflows the weights within a few steps: the run stops at the first step whose loss or
    gradient norm is not finite, in one line naming it and what to try, without retrying it; no checkpoint
    from that step on commits, and the run is never "completed". Also between saves: the step's line read
    back is enough to stop it, a step later."""
    from distrain.cluster.placement import WorkerFailure

    cfg = make_config(
        tmp_path, "run.name=nan", "optim.lr=1e30", "trainer.max_steps=40", f"checkpoint.interval={interval}"
    )
    with pytest.raises(WorkerFailure, match=r"not finite \(NaN or inf\) at step (\d+);.*lower optim.lr") as failed:
        train(cfg)
    line = str(failed.value)
    first = int(line.split(" at step ")[1].split(";")[0])
    assert "\n" not in line and 1 < first < 12, line
    assert max(logged(cfg)) <= first + 1  # no step trained on NaN weights past the one that read it back
    checkpoints = Path(cfg.run_dir) / "checkpoints"
    saved = [int(p.name.removeprefix("step_")) for p in checkpoints.iterdir()] if checkpoints.exists() else []
    assert max(saved, default=0) < first and (saved or not interval), (saved, first)
    summary = json.loads((Path(cfg.run_dir) / "summary.json").read_text())
    assert summary["status"] == "failed" and len(summary["attempts"]) == 1
