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
    (torn / "__3_0.distcp").write_bytes(b"a rank the resumed run no longer has")
    save(tmp_path, 20, model)  # the resumed run reaches step 20 again
    assert checkpoint.latest(tmp_path).name == "step_00000020"
    manifest = json.loads((torn / checkpoint.COMMIT_MARKER).read_text())
    on_disk = {p.name for p in torn.iterdir()} - {checkpoint.COMMIT_MARKER}
    assert "__3_0.distcp" not in on_disk and set(manifest["files"]) == on_disk  # emptied before the save


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


def test_a_torn_directory_never_takes_a_kept_slot(tmp_path: Path):
    """keep=2 keeps two checkpoints that load: a torn one between them is no commit, and one older than
    the kept ones is deleted with them."""
    model = nn.Linear(2, 2)
    save(tmp_path, 10, model)
    save(tmp_path, 20, model)
    for step in (15, 25):
        checkpoint.step_dir(tmp_path, step).mkdir()
        (checkpoint.step_dir(tmp_path, step) / "__0_0.distcp").write_bytes(b"partial")
    save(tmp_path, 30, model)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step_00000030", "step_00000025", "step_00000020"]
    assert checkpoint.problem(checkpoint.step_dir(tmp_path, 20)) is None  # the older good one is kept


def test_a_file_rank_0_cannot_see_leaves_the_checkpoint_uncommitted(tmp_path: Path):
    """What a node-local run.storage looks like at commit: rank 1 wrote a shard that rank 0 does not see
    (or sees at another size). Nothing is committed and nothing older is pruned."""
    model = nn.Linear(2, 2)
    save(tmp_path, 10, model, keep=1)
    path = checkpoint.prepare(tmp_path, 20)
    (path / "__0_0.distcp").write_bytes(b"rank 0's shard")
    seen = {"__0_0.distcp": len(b"rank 0's shard")}
    for other, match in (({"__1_0.distcp": 9}, "sees no such file"), ({"__0_0.distcp": 99}, "sees 14 bytes")):
        with pytest.raises(checkpoint.CheckpointNotSharedError, match=f"rank 1 wrote .* but rank 0 {match}"):
            checkpoint.commit(tmp_path, 20, {"rank 0": seen, "rank 1": other}, 1, "rank 0")
        assert not (path / checkpoint.COMMIT_MARKER).exists()
        assert checkpoint.latest(tmp_path) == checkpoint.step_dir(tmp_path, 10)


def test_a_nodes_mirror_of_a_store_is_pruned_though_it_holds_only_its_ranks_files(tmp_path: Path):
    """On a run on an object store each node's mirror holds its own ranks' files of a step, marked committed once
    the store holds them all (remote.py): the mirror keeps checkpoint.keep of the committed steps, drops a torn one
    older than those, and leaves one newer than the commit; checkpoint.prune alone, which wants every file the
    marker lists, would have kept them all for ever."""
    from distrain.storage.remote import prune_mirror

    files = {"__0_0.distcp": 8, "__2_0.distcp": 8}  # rank 0's and rank 2's: this node holds rank 2's
    for step in (2, 4, 6, 8, 10):
        path = checkpoint.step_dir(tmp_path, step)
        path.mkdir()
        (path / "__2_0.distcp").write_bytes(b"x" * 8)
        if step not in (4, 10):  # 4: a save torn on this node; 10: saved after the commit pruned here
            (path / checkpoint.COMMIT_MARKER).write_text(json.dumps({"step": step, "files": files}))
    checkpoint.prune(tmp_path, 2, 8)
    assert len(checkpoint.checkpoints(tmp_path)) == 5
    prune_mirror(tmp_path, 2, 8)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step_00000010", "step_00000008", "step_00000006"]
