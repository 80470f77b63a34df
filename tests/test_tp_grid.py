"""2-D, 2.5-D and 3-D tensor parallelism (distrain/parallel/tpnd/): the loss and gradient norm of every
one of 10 steps match a one-process run to 1e-4 (they agree to ~1e-6: the grid only reorders sums);
a grid run's checkpoint resumes on one worker and under 1-D tensor parallelism and goes on as the
one-process run did; the plan shows the grid.

The 2×2 grid's run serves its parity case and, through its checkpoint of step 5, both resumes; the resumes
come first, so that the groups of 1, 2 and 4 workers they and that run use are still warm (a worker's start
costs more than its steps), and the two shapes of 8 (blocks of 8: 2.5-D and 3-D; of 4: dp2 and pp2 × 2-D)
come last, one after the other."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import LayoutArgs, assert_matches, fake_table, logged, make_config

from distrain.config import TrainConfig
from distrain.driver.launch import train
from distrain.driver.plan import describe
from distrain.strategy.resolve import resolve
from distrain.strategy.tensor_parallel import tp_coordinate

STEPS = 10
TOL = 1e-4

GRIDS = {
    # id: (workers, overrides)
    "2d": (4, ["strategy=tp2d"]),
    "2.5d": (8, ["strategy=tp2p5d", "trainer.micro_batch_size=4"]),  # d=2 grids of 2×2: 4 sequences per micro-batch
    "3d": (8, ["strategy=tp3d", "trainer.micro_batch_size=4"]),  # 2×2×2: q² = 4 sequences per micro-batch
    "dp2_2d": (8, ["strategy=tp2d"]),  # two 2×2 grids, data-parallel
    "pp2_2d": (8, ["strategy=tp2d", "strategy.pp=2"]),  # a 2×2 grid per pipeline stage (1f1b, 4 micro-batches)
}


@pytest.fixture(scope="module")
def reference(ray_cluster, tmp_path_factory) -> dict[str, dict[int, float]]:
    cfg = make_config(
        tmp_path_factory.mktemp("ref"), "run.name=ref", "cluster.num_workers=1", f"trainer.max_steps={STEPS}"
    )
    train(cfg)
    return {"loss": logged(cfg), "grad_norm": logged(cfg, "grad_norm")}


def grid_run(storage: Path, grid: str, *extra: str) -> TrainConfig:
    workers, overrides = GRIDS[grid]
    cfg = make_config(
        storage, "run.name=grid", f"cluster.num_workers={workers}", f"trainer.max_steps={STEPS}", *overrides, *extra
    )
    assert train(cfg)["status"] == "completed"
    return cfg


@pytest.fixture(scope="module")
def grid_2d(ray_cluster, tmp_path_factory) -> TrainConfig:
    """The 2×2 grid's run, with a checkpoint of step 5 beside its last: the first half of both resumes."""
    return grid_run(tmp_path_factory.mktemp("grid_2d"), "2d", f"checkpoint.interval={STEPS // 2}", "checkpoint.keep=2")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "then", [(1, ["strategy=ddp"]), (2, ["strategy=tp"])], ids=["on_one_worker", "under_1d_tp"]
)  # fmt: skip
def test_grid_checkpoint_resumes_under_another_layout(then: LayoutArgs, grid_2d, reference, tmp_path: Path):
    """Half the run on a 2×2 grid (its checkpoint of step 5, in a run directory of its own), the rest from that
    checkpoint on one worker or under 1-D TP, on the whole run's schedule."""
    half = f"step_{STEPS // 2:08d}"
    shutil.copytree(Path(grid_2d.run_dir) / "checkpoints" / half, tmp_path / "resume" / "checkpoints" / half)
    workers, overrides = then
    cfg = make_config(
        tmp_path, "run.name=resume", f"cluster.num_workers={workers}", f"trainer.max_steps={STEPS}", *overrides
    )
    summary = train(cfg)
    assert summary["status"] == "completed" and summary["resumed_from"].endswith(half)
    assert_matches(cfg, reference, range(STEPS // 2 + 1, STEPS + 1), TOL)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("grid", GRIDS)
def test_grid_matches_one_process(grid: str, reference, request, tmp_path: Path):
    cfg = request.getfixturevalue("grid_2d") if grid == "2d" else grid_run(tmp_path, grid)
    assert sorted(logged(cfg)) == list(range(1, STEPS + 1))
    assert_matches(cfg, reference, range(1, STEPS + 1), TOL)


def test_layout_lays_the_tp_dim_out_as_the_grid(tmp_path: Path):
    cfg = make_config(tmp_path, "strategy=tp2p5d", "cluster.num_workers=16", "trainer.micro_batch_size=4")
    layout = resolve(cfg)
    assert layout.mesh_sizes() == {
        "pp": 1,
        "dp_replicate": 2,
        "dp_shard": 1,
        "cp": 1,
        "tp_depth": 2,
        "tp_row": 2,
        "tp_col": 2,
    }
    assert tp_coordinate(layout, 13) == {"tp_depth": 1, "tp_row": 0, "tp_col": 1}  # 13 = 8 + 4·1 + 2·0 + 1
    assert layout.groups("tp_col")[:2] == [[0, 1], [2, 3]]
    assert layout.groups("tp_depth")[:2] == [[0, 4], [1, 5]]
    assert layout.groups("dp_replicate")[0] == [0, 8]


def test_plan_shows_which_rank_holds_which_block(tmp_path: Path):
    cfg = make_config(tmp_path, "strategy=tp3d", "cluster.num_workers=8", "trainer.micro_batch_size=4")
    text = describe(cfg, resolve(cfg), fake_table(8, 8, gpus=False))
    lines = text.splitlines()
    assert "  tp_i: [0,1] [2,3] [4,5] [6,7]" in lines and "  tp_j: [0,4] [1,5] [2,6] [3,7]" in lines
    # rank 6 = (j 1, k 1, i 0): the stream's sequences i·q + j = 1 and hidden chunk k = 1 (16-31 of 32); the
    # projections reading it hold out chunk j·q + i = 2 of 4 (16-23) × in chunk k, those writing to it out
    # chunk k·q + i = 2 × in chunk j = 1.
    assert (
        "  rank 6 (tp_j 1, tp_k 1, tp_i 0): sequences 1-1, hidden 16-31; projections reading the stream "
        "W[out 16-23, in 16-31], writing to it W[out 16-23, in 16-31]"
    ) in lines
    assert "mesh pp=1 × dp_replicate=1 × dp_shard=1 × cp=1 × tp_j=2 × tp_k=2 × tp_i=2" in text
