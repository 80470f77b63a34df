"""The exact state each layout hands to DCP holds only tensors and plain data, and a run's Saver commits it
in the background save after save; ZeRO-1 with a parameter group empty on a rank resumes from it bit for bit.
(The parameter server's own state: test_ps.py's restored-server test.)"""

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
    # One block: 3 norm gains in the no-decay group, so ZeroRedundancyOptimizer leaves that group empty on one of
    # the 4 ranks, which DCP's load cannot take (state.empty_groups_aside); resumed from its first save below.
    "zero1_one_block": ("strategy=zero1", "model.n_layers=1"),
}
RESUMED = ("zero1_one_block",)


def save_every_layout(rank: int, port: int, cases: dict, out: str) -> None:
    """One rank: each layout's Learner and optimizer after a step; its checkpoint state, saved twice by
    one Saver as a run saves it; what each state held that is neither a tensor nor plain data. A layout in
    RESUMED is then resumed from its first save, its second step taken again: the state the first took."""
    rank_env(rank, WORLD, port, CUDA_VISIBLE_DEVICES="")
    from distrain.config import from_plain
    from distrain.parallel import process_group
    from distrain.storage import safeload, saver
    from distrain.strategy.layout import Layout
    from distrain.train.faults import Faults
    from distrain.train.job import FromCheckpoint
    from distrain.train.learner import Learner
    from distrain.train.nvme import nvme_scratch
    from distrain.train.optim import build_optimizer, local_optimizers
    from distrain.train.state import CheckpointSource, RankState, checkpoint_state, rng_states

    device = process_group.init_from_env()
    found, resumed = {}, {}

    def built(cfg, layout: Layout) -> tuple:
        learner = Learner(cfg, layout, layout.data_shard(rank), device, Faults(cfg.fault, rank, None))
        return learner, build_optimizer(
            learner.module, cfg.optim, learner.parallel.zero1_group, nvme_scratch(cfg, rank)
        )

    def step(learner, optimizer, number: int) -> None:
        learner.forward_backward(number)
        learner.parallel.clip_grad_norm(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for name, (plain, layout) in cases.items():
        cfg, layout = from_plain(plain), Layout.from_dict(layout)
        learner, optimizer = built(cfg, layout)
        background = cfg.strategy.offload != "nvme"  # as the trainer chooses
        writer = saver.Saver(Path(out, name), keep=2, background=background)
        for number in (1, 2):
            step(learner, optimizer, number)
            state, _ = checkpoint_state(learner, optimizer)
            found[name] = safeload.unplain_leaves(state)
            if number == 1:  # a copy: the next step changes the tensors in place
                first = {part: {k: copied(v) for k, v in values.items()} for part, values in state.items()}
            writer.save(number, state, {"step": number, "loss": 0.0, "world_size": WORLD}, rng_states(device))
        writer.close()
        if name in RESUMED:
            again = RankState(*built(cfg, layout), device, layout, rank)
            again.restore(CheckpointSource(FromCheckpoint(str(Path(out, name, "step_00000001"))), None, Path(out)))
            loaded = differing(first, again.capture()[0], 0.0)
            step(again.learner, again.optimizer, 2)
            empty = any(not g["params"] for o in local_optimizers(optimizer) for g in o.param_groups)
            resumed[name] = {"empty": empty, "loaded": loaded, "stepped": differing(state, again.capture()[0], 1e-6)}
    torch.save({"found": found, "resumed": resumed}, Path(out, f"rank{rank}.pt"))
    process_group.destroy()


def copied(value: object) -> object:
    return value.clone() if torch.is_tensor(value) else value


def differing(want: dict, got: dict, tol: float) -> list[str]:
    """The keys of two checkpoint states (flat in each part) whose values differ by more than `tol`."""

    def same(a: object, b: object) -> bool:
        return torch.allclose(a, b, rtol=0, atol=tol) if torch.is_tensor(a) else a == b

    return [f"{part}.{k}" for part, values in want.items() for k, v in values.items() if not same(v, got[part][k])]


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
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    for rank, result in enumerate(results):
        assert result["found"] == {name: [] for name in LAYOUTS}, f"rank {rank}"
        for name, r in result["resumed"].items():  # the load bit for bit; the step then within fp32's rounding
            assert not r["loaded"] and not r["stepped"], (rank, name, r)
    assert all(any(r["resumed"][name]["empty"] for r in results) for name in RESUMED)  # the case it is there for
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
