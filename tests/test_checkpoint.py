"""Checkpoints on one rank: commit marker, retention, torn directories, per-rank state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from distrain.storage import checkpoint, safeload, saver

pytestmark = pytest.mark.usefixtures("process_group")


def save(root: Path, step: int, model: nn.Module, keep: int = 2) -> Path:
    meta = {"step": step, "world_size": 1}
    return saver.save(root, step, {"model": model.state_dict()}, meta, {"rng": torch.get_rng_state()}, keep)


def test_retention_keeps_the_newest_committed_and_loads_exactly(tmp_path: Path):
    model = nn.Linear(4, 4)
    for step in (1, 2, 3, 4):
        with torch.no_grad():
            model.weight.fill_(step)
        rng_at_save = torch.get_rng_state()
        save(tmp_path, step, model, keep=2)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step_00000004", "step_00000003"]
    manifest = json.loads((tmp_path / "step_00000004" / checkpoint.COMMIT_MARKER).read_text())
    assert manifest["step"] == 4 and {"meta.json", "rank_00000.pt", ".metadata"} <= manifest["files"].keys()

    fresh = nn.Linear(4, 4)
    state = {"model": fresh.state_dict()}
    meta, rank_state = checkpoint.load(checkpoint.latest(tmp_path), state)
    assert meta["step"] == 4 and torch.equal(fresh.weight, torch.full((4, 4), 4.0))
    assert torch.equal(rank_state["rng"], rng_at_save)


def test_a_torn_newer_directory_is_skipped_then_replaced(tmp_path: Path, capsys):
    model = nn.Linear(2, 2)
    save(tmp_path, 10, model)
    torn = checkpoint.step_dir(tmp_path, 20)
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"partial")
    assert checkpoint.latest(tmp_path).name == "step_00000010"
    assert "step_00000020: no commit marker" in capsys.readouterr().err
    save(tmp_path, 20, model)  # the resumed run reaches step 20 again
    assert checkpoint.latest(tmp_path).name == "step_00000020"
    assert not (torn / "__0_0.distcp").exists() or (torn / checkpoint.COMMIT_MARKER).exists()


def test_a_lone_torn_directory_says_that_nothing_is_loaded(tmp_path: Path, capsys):
    """A stop killed before its first checkpoint committed: the rerun starts over, and says so."""
    torn = checkpoint.step_dir(tmp_path, 24)
    torn.mkdir(parents=True)
    (torn / "__0_0.distcp").write_bytes(b"partial")
    assert checkpoint.latest(tmp_path) is None
    assert "no older checkpoint, so nothing is loaded (a run starts at step 0)" in capsys.readouterr().err


def test_an_unreadable_marker_is_damage(tmp_path: Path):
    path = save(tmp_path, 5, nn.Linear(2, 2))
    (path / checkpoint.COMMIT_MARKER).write_text("{not json")
    with pytest.raises(safeload.DamagedCheckpointError, match="step_00000005: unreadable commit marker"):
        checkpoint.latest(tmp_path)
