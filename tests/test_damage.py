"""Damaged checkpoints, on one rank with real saves: each damage found before anything is loaded, the newest
checkpoint that verifies loaded instead with one line; when none verifies, one error and nothing deleted."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import pytest
import torch
from conftest import DAMAGES, damage
from torch import nn

from distrain.storage import checkpoint, integrity, safeload, saver

pytestmark = pytest.mark.usefixtures("process_group")


def save_steps(root: Path, *steps: int) -> nn.Module:
    """A checkpoint at each step, its weights filled with the step (a shard of 16 KiB and more)."""
    model = nn.Linear(64, 64)
    for step in steps:
        with torch.no_grad():
            model.weight.fill_(step)
        meta = {"step": step, "world_size": 1}
        saver.save(root, step, {"model": model.state_dict()}, meta, {"rng": torch.get_rng_state()}, keep=5)
    return model


def files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_manifest_records_each_files_crc32(tmp_path: Path):
    save_steps(tmp_path, 3)
    path = checkpoint.step_dir(tmp_path, 3)
    manifest = json.loads((path / checkpoint.COMMIT_MARKER).read_text())
    on_disk = {p.name: zlib.crc32(p.read_bytes()) for p in path.iterdir() if p.name != checkpoint.COMMIT_MARKER}
    assert manifest["crc32"] == on_disk and manifest["files"].keys() == on_disk.keys()


@pytest.mark.parametrize("kind", DAMAGES)
def test_each_damage_falls_back_to_the_older_checkpoint_in_one_line(tmp_path: Path, capsys, kind: str):
    """Step 20 verified first in this process (its verdict kept), then damaged in place: the damage is seen."""
    model = save_steps(tmp_path, 10, 20)
    newest = checkpoint.step_dir(tmp_path, 20)
    for f in newest.iterdir():  # saved a while ago: a write now cannot share its timestamp's tick
        os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns - 10**10))
    assert checkpoint.latest(tmp_path) == newest
    damage(newest, kind)
    capsys.readouterr()
    path = checkpoint.latest(tmp_path)
    assert path.name == "step_00000010"
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1, said
    assert "step_00000020" in said[0] and DAMAGES[kind] in said[0] and "loading step_00000010" in said[0], said
    assert checkpoint.latest(tmp_path) == path and capsys.readouterr().err == ""  # said once, not per look
    meta, _ = checkpoint.load(path, {"model": model.state_dict()})
    assert meta["step"] == 10 and torch.equal(model.weight, torch.full((64, 64), 10.0))


def test_when_none_verifies_one_error_and_nothing_is_deleted(tmp_path: Path):
    save_steps(tmp_path, 10, 20)
    damage(checkpoint.step_dir(tmp_path, 20), "tensor_bytes")
    damage(checkpoint.step_dir(tmp_path, 10), "meta_garbled")
    before = files(tmp_path)
    with pytest.raises(safeload.DamagedCheckpointError) as refused:
        checkpoint.latest(tmp_path)
    line = str(refused.value)
    assert "\n" not in line and "nothing was deleted" in line
    assert "step_00000020: __0_0.distcp no longer matches" in line and "step_00000010: meta.json" in line, line
    assert files(tmp_path) == before


@pytest.mark.parametrize("kind", ["tensor_bytes", "meta_garbled"])
def test_a_run_resumed_below_a_damaged_checkpoint_keeps_what_it_saves(tmp_path: Path, kind: str):
    """Resumed from step 10 below a damaged step 20, the run's save of step 15 is not pruned for the damaged
    one (whose sizes are right), which stays until the run saves step 20 again."""
    save_steps(tmp_path, 10, 20)
    damage(checkpoint.step_dir(tmp_path, 20), kind)
    assert checkpoint.latest(tmp_path).name == "step_00000010"
    before = files(checkpoint.step_dir(tmp_path, 20))
    model = nn.Linear(64, 64)
    saver.save(tmp_path, 15, {"model": model.state_dict()}, {"step": 15}, {}, keep=1)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step_00000020", "step_00000015"]
    assert checkpoint.latest(tmp_path).name == "step_00000015"
    assert files(checkpoint.step_dir(tmp_path, 20)) == before


def test_a_checkpoint_committed_without_checksums_loads_by_its_sizes(tmp_path: Path, capsys):
    """What today's code wrote before this change: the manifest has sizes only."""
    model = save_steps(tmp_path, 10)
    path = checkpoint.step_dir(tmp_path, 10)
    manifest = json.loads((path / checkpoint.COMMIT_MARKER).read_text())
    del manifest["crc32"]
    (path / checkpoint.COMMIT_MARKER).write_text(json.dumps(manifest))
    assert checkpoint.latest(tmp_path) == path
    assert checkpoint.load(path, {"model": model.state_dict()})[0]["step"] == 10
    # A damaged rank file is named damaged, not "could run code"; an unreadable meta.json is found up front.
    damage(path, "rank_file_random")
    with pytest.raises(safeload.DamagedCheckpointError, match="rank_00000.pt is damaged"):
        checkpoint.load(path, {"model": model.state_dict()})
    damage(path, "meta_garbled")
    with pytest.raises(safeload.DamagedCheckpointError, match="step_00000010: meta.json is unreadable"):
        checkpoint.latest(tmp_path)


def test_a_manifest_whose_checksums_miss_a_file_or_a_meta_without_a_step_is_not_loaded(tmp_path: Path):
    """Two damages no byte check sees: a commit marker whose crc32 list leaves a file out (that file would load
    unchecked), and a meta.json rewritten whole, its checksum recorded anew, that no longer says its step."""
    save_steps(tmp_path, 10)
    (path,) = checkpoint.checkpoints(tmp_path)
    marker = path / checkpoint.COMMIT_MARKER
    manifest = json.loads(marker.read_text())
    assert checkpoint.problem(path) is None
    short = dict(manifest, crc32={k: v for k, v in manifest["crc32"].items() if k != "meta.json"})
    marker.write_text(json.dumps(short))
    assert checkpoint.problem(path) == "unreadable commit marker (its checksums do not cover its files)"
    meta = path / checkpoint.META_FILE
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "step"}))
    files = dict(manifest["files"], **{meta.name: meta.stat().st_size})
    sums = dict(manifest["crc32"], **{meta.name: integrity.checksum(meta)})
    marker.write_text(json.dumps(dict(manifest, files=files, crc32=sums)))
    assert checkpoint.problem(path) == f"{checkpoint.META_FILE} is unreadable (no step in it)"
