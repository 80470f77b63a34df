"""The exact state each layout hands to DCP holds only tensors and plain data, and a run's Saver commits it
in the background save after save. (The parameter server's own state: test_ps.py's restored-server test.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import free_port, make_config, rank_env, spawn_ranks

WORLD = 4
# Every layout of a collective run on 4 ranks: (name, overrides). The grid is tp2d's 2×2.
LAYOUTS = {
    "ddp": ("strategy=ddp",),
    "zero1": ("strategy=zero1",),
    "zero2": ("strategy=zero2",),
    "zero3": ("strategy=zero3",),
    "hsdp": ("strategy=hsdp",),
    "offload": ("strategy=offload",),
    "nvme": ("strategy=nvme",),
    "tp": ("strategy=tp",),
    "fsdp_tp": ("strategy=fsdp_tp",),
    "pp": ("strategy=pp", "trainer.micro_batch_size=1"),
    "tp2d": ("strategy=tp2d",),
}


def save_every_layout(rank: int, port: int, cases: dict, out: str) -> None:
    """One rank: each layout's Learner and optimizer after a step; its checkpoint state, saved twice by
    one Saver as a run saves it; what each state held that is neither a tensor nor plain data."""
    rank_env(rank, WORLD, port, CUDA_VISIBLE_DEVICES="")
    from distrain.config import from_plain
    from distrain.parallel import process_group
    from distrain.storage import safeload, saver
    from distrain.strategy.layout import Layout
    from distrain.train.faults import Faults
    from distrain.train.learner import Learner
    from distrain.train.nvme import nvme_scratch
    from distrain.train.optim import build_optimizer
    from distrain.train.state import checkpoint_state

    device = process_group.init_from_env()
    found = {}
    for name, (plain, layout) in cases.items():
        cfg, layout = from_plain(plain), Layout.from_dict(layout)
        learner = Learner(cfg, layout, layout.data_shard(rank), device, Faults(cfg.fault, rank, None))
        optimizer = build_optimizer(learner.module, cfg.optim, learner.parallel.zero1_group, nvme_scratch(cfg, rank))
        background = cfg.strategy.offload != "nvme"  # as the trainer chooses
        writer = saver.Saver(Path(out, name), keep=2, background=background)
        for step in (1, 2):
            learner.forward_backward(step)
            learner.parallel.clip_grad_norm(1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            state, _ = checkpoint_state(learner, optimizer)
            found[name] = safeload.unplain_leaves(state)
            writer.save(step, state, {"step": step, "world_size": WORLD}, {})
        writer.close()
    torch.save(found, Path(out, f"rank{rank}.pt"))
    process_group.destroy()


@pytest.mark.timeout(300)
def test_every_layout_checkpoints_only_tensors_and_plain_data_save_after_save(tmp_path: Path):
    from distrain.config import to_plain
    from distrain.driver.validation import validate
    from distrain.storage import checkpoint

    (tmp_path / "nvme").mkdir()
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "text.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 500)

    def case(*overrides: str) -> tuple:
        cfg = make_config(
            tmp_path,
            f"cluster.num_workers={WORLD}",
            f"data.path={tmp_path / 'corpus'}",
            f"strategy.nvme_path={tmp_path / 'nvme'}",
            *overrides,
        )
        return to_plain(cfg), validate(cfg).as_dict()

    cases = {name: case(*overrides) for name, overrides in LAYOUTS.items()}
    spawn_ranks(save_every_layout, (free_port(), cases, str(tmp_path)), WORLD)
    for rank in range(WORLD):
        found = torch.load(tmp_path / f"rank{rank}.pt")
        assert found == {name: [] for name in LAYOUTS}, f"rank {rank}"
    for name in LAYOUTS:  # both saves committed: the second is where torch 2.11's stager failed
        assert [p.name for p in checkpoint.checkpoints(tmp_path / name)] == ["step_00000002", "step_00000001"]
        assert all(checkpoint.problem(p) is None for p in checkpoint.checkpoints(tmp_path / name)), name


def test_a_leaf_that_is_not_a_tensor_or_plain_data_is_named_and_nothing_is_written(tmp_path: Path):
    from distrain.storage import safeload

    state = {"model": {"w": torch.ones(2)}, "optim": {"step": 3, "betas": (0.9, 0.95), "kind": torch.optim.AdamW}}
    assert safeload.unplain_leaves(state) == ["optim.kind (type)"]
    with pytest.raises(TypeError, match=r"holds optim.kind \(type\): a checkpoint holds only tensors"):
        safeload.refuse_unplain(state, "the state of step 3")
    assert safeload.unplain_leaves({"pieces": [slice(0, 2)]}, allowed=[slice]) == []
