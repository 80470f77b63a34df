"""The parameter server: each mode's training checked against the one it must equal, its
bounds, its exchange equations, and its survival of dead workers and servers."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from conftest import final_weights, logged, make_config
from test_fault_tolerance import in_background, when

from distrain import checkpoint
from distrain.config import TrainConfig
from distrain.data.corpus import load_tokens, unigram_entropy
from distrain.launch import train
from distrain.model.llama import Transformer
from distrain.ps.server import ParameterServer, elastic_exchange, feasible, load_weights
from distrain.ps.shard import plan_shards
from distrain.tracking import read_metrics

STEPS = 10
# The main job's nano model, batch and schedule (conf/), not the tests' tiny ones, for 60 steps.
NANO = (
    "model.dim=128",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.ffn_dim=384",
    "trainer.seq_len=128",
    "trainer.global_batch_size=32",
    "trainer.micro_batch_size=8",
    "trainer.max_steps=60",
    "trainer.eval_batches=4",
    "optim.warmup_steps=20",
)
# async and Hogwild apply one update per worker's gradient, num_workers per global batch: the
# learning rate per update is scaled down by the 2 workers.
PER_UPDATE_LR = {"async": ["optim.lr=1.5e-3"], "hogwild": ["optim.lr=1.5e-3"]}
STRAGGLER = ("trainer.straggler=3", "trainer.straggler_slowdown=20")  # the tiny model's steps take ~10 ms
SGD = ("optim=sgd", "optim.lr=0.3", f"trainer.max_steps={STEPS}")


def ps_weights(cfg: TrainConfig) -> dict:
    """The whole model's weights from the run's newest committed parameter-server checkpoint."""
    model = Transformer(cfg.model, cfg.trainer.seq_len)
    load_weights(checkpoint.latest(Path(cfg.run_dir) / "checkpoints"), model)
    return model.state_dict()


def assert_close(got: dict, want: dict, tol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=tol, atol=tol, msg=name)


# -- the pieces, without Ray ------------------------------------------------------------------------


def test_shards_are_balanced_and_cover_every_element_once():
    params = [("a", torch.zeros(10, 3)), ("b", torch.zeros(7)), ("c", torch.zeros(100)), ("d", torch.zeros(2, 2))]
    shards = plan_shards(params, 3)
    sizes = [sum(p.size for p in shard) for shard in shards]
    assert sizes == [47, 47, 47]  # 141 elements: equal to one element
    covered = {name: [] for name, _ in params}
    for shard in shards:
        for piece in shard:
            covered[piece.name].append((piece.start, piece.end))
    for name, p in params:  # each parameter's pieces tile it exactly, in order
        spans = sorted(covered[name])
        assert spans[0][0] == 0 and spans[-1][1] == p.numel()
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert [p.name for p in shards[1]] == ["c"]  # the large tensor is the one split
    assert {p.decay for s in shards for p in s if p.name == "a"} == {True}


def test_easgd_exchange_follows_the_update_equations():
    x = torch.tensor([1.0, -2.0, 4.0, 0.5])  # a worker's weights
    centre = torch.tensor([0.0, 2.0, 4.0, -1.5])
    alpha = 0.25
    want_x = x - alpha * (x - centre)  # x_i ← x_i − α(x_i − x̃)
    want_centre = centre + alpha * (x - centre)  # x̃ ← x̃ + α(x_i − x̃), with the same old values
    diff = elastic_exchange(x.clone(), centre, alpha)
    assert torch.equal(x - diff, want_x)
    assert torch.equal(centre, want_centre)
    assert torch.equal(diff, torch.tensor([0.25, -1.0, 0.0, 0.5]))


def test_the_easgd_server_moves_its_centre_by_the_exchange(tmp_path: Path):
    cfg = make_config(tmp_path, "strategy=ps", "strategy.mode=easgd", "strategy.alpha=0.5", "run.name=x")
    from distrain.config import to_plain
    from distrain.validation import validate

    validate(cfg)
    server = ParameterServer({"config": to_plain(cfg)}, 0)
    centre = server.flat.clone()
    worker = centre + torch.linspace(-1, 1, centre.numel())
    answer = server.exchange(0, 4, worker.numpy())
    assert torch.allclose(torch.from_numpy(answer["diff"]), 0.5 * (worker - centre))
    assert torch.allclose(server.flat, centre + 0.5 * (worker - centre))
    assert server.exchange(0, 4, worker.numpy())["applied"] is False  # the same step twice counts once
    assert server.version == 1


def test_a_bounded_staleness_turn_is_given_oldest_first():
    assert feasible([3, 4], version=5, bound=2)  # 3 lands at 5 (2 late), 4 at 6 (2 late)
    assert not feasible([3, 3], version=5, bound=2)  # the second 3 would land at 6: 3 late
    assert feasible([], version=9, bound=0)


# -- whole runs -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ddp_sgd(ray_cluster, tmp_path_factory) -> TrainConfig:
    cfg = make_config(tmp_path_factory.mktemp("ddp"), "run.name=ddp", "cluster.num_workers=4", *SGD)
    train(cfg)
    return cfg


def test_sync_is_ddp(ddp_sgd, tmp_path: Path):
    """Two shards (a tensor split between them), four workers: the same training as DDP."""
    cfg = make_config(tmp_path, "run.name=sync", "strategy=ps", "strategy.num_servers=2", "cluster.num_workers=4", *SGD)
    assert train(cfg)["status"] == "completed"
    for key in ("loss", "grad_norm"):
        got, want = logged(cfg, key), logged(ddp_sgd, key)
        assert sorted(got) == list(range(1, STEPS + 1))
        for step in got:
            assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-5), f"{key} at step {step}"
    assert_close(ps_weights(cfg), final_weights(ddp_sgd), 1e-5)
    assert all(m["dropped"] == 0 and m["workers"] == 4 for m in read_metrics(cfg.run_dir))


def test_async_with_one_worker_is_one_process_sgd(ray_cluster, tmp_path: Path):
    one = make_config(tmp_path, "run.name=one", "cluster.num_workers=1", *SGD)
    train(one)
    cfg = make_config(tmp_path, "run.name=async", "strategy=ps", "strategy.mode=async", "cluster.num_workers=1", *SGD)
    train(cfg)
    assert logged(cfg) == logged(one)  # exactly
    assert_close(ps_weights(cfg), final_weights(one), 0.0)
    assert {m["staleness_max"] for m in read_metrics(cfg.run_dir)} == {0}


def test_bounded_staleness_is_never_exceeded(ray_cluster, tmp_path: Path):
    common = ("strategy=ps", "strategy.mode=async", "cluster.num_workers=4", "trainer.max_steps=15", *STRAGGLER)
    free = make_config(tmp_path, "run.name=free", *common)
    train(free)
    bounded = make_config(tmp_path, "run.name=bounded", "strategy.max_staleness=1", *common)
    train(bounded)
    assert max(m["staleness_max"] for m in read_metrics(free.run_dir)) > 1  # the bound has work to do
    assert max(m["staleness_max"] for m in read_metrics(bounded.run_dir)) <= 1


def test_backup_workers_apply_the_first_gradients_of_each_step(ray_cluster, tmp_path: Path):
    steps = 12
    cfg = make_config(
        tmp_path,
        "run.name=backup",
        "strategy=ps",
        "strategy.backup_workers=1",
        "cluster.num_workers=4",
        f"trainer.max_steps={steps}",
        *STRAGGLER,
    )
    assert train(cfg)["status"] == "completed"
    lines = read_metrics(cfg.run_dir)
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    assert all(m["workers"] - m["dropped"] == 3 for m in lines)  # each round took exactly 4 − 1
    unused = sum(m["dropped"] for m in lines) + 4 * steps - sum(m["workers"] for m in lines)  # dropped or skipped
    assert unused >= steps // 2  # the rounds did not wait for the straggler


@pytest.mark.parametrize("mode", ["sync", "async", "hogwild", "easgd"])
def test_every_mode_trains_the_nano_model_well_below_the_unigram_baseline(ray_cluster, tmp_path: Path, mode):
    cfg = make_config(
        tmp_path, f"run.name={mode}", "strategy=ps", f"strategy.mode={mode}", *NANO, *PER_UPDATE_LR.get(mode, [])
    )
    summary = train(cfg)
    baseline = unigram_entropy(load_tokens(None))
    assert summary["status"] == "completed" and summary["final_step"] == 60
    # Seen: 2.44 (sync) to 2.56 (async) against 3.25; the margin covers the asynchronous modes' run-to-run spread.
    assert summary["final_val_loss"] < 0.85 * baseline, f"{mode}: {summary['final_val_loss']:.3f} vs {baseline:.3f}"


def kill_when(run_dir: Path, step: int, pick) -> None:
    """SIGKILL the process `pick` chooses from placement.json once metrics.jsonl reaches `step`."""
    when(lambda: any(m["step"] >= step for m in read_metrics(str(run_dir))))
    os.kill(pick(json.loads((run_dir / "placement.json").read_text()))["pid"], signal.SIGKILL)


def test_a_dead_async_worker_is_replaced_while_the_others_go_on(ray_cluster, tmp_path: Path):
    steps = 40
    cfg = make_config(
        tmp_path,
        "run.name=kill",
        "strategy=ps",
        "strategy.mode=async",
        "cluster.num_workers=3",
        f"trainer.max_steps={steps}",
        "trainer.global_batch_size=12",
        "trainer.straggler=1",  # the victim: slow, so still training when it is killed
        "trainer.straggler_slowdown=20",
    )
    run_dir = Path(cfg.run_dir)
    killer = in_background(lambda: kill_when(run_dir, 5, lambda placed: placed[1]))
    summary = train(cfg)
    killer.join()
    assert not killer.errors
    assert summary["status"] == "completed" and summary["final_step"] == steps
    assert len(summary["attempts"]) == 1 and summary["restarts"] == 1  # one worker replaced, the run never restarted
    (replacement,) = summary["ps"]["replacements"]
    assert replacement["worker"] == 1 and "ActorDiedError" in replacement["cause"]
    lines = read_metrics(cfg.run_dir)
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    assert lines[-1]["workers"] == 3  # the replacement finished the run beside the others


def test_a_dead_server_is_restored_from_the_last_checkpoint(ray_cluster, tmp_path: Path):
    steps = 60
    cfg = make_config(
        tmp_path,
        "run.name=server",
        "strategy=ps",
        "strategy.mode=async",
        "strategy.num_servers=2",
        "cluster.num_workers=2",
        f"trainer.max_steps={steps}",
        "checkpoint.interval=5",
        "trainer.straggler=1",  # a slow worker keeps the run going for seconds
        "trainer.straggler_slowdown=10",
    )
    run_dir = Path(cfg.run_dir)
    seen = []

    def kill_server_after_a_checkpoint() -> None:
        when(lambda: checkpoint.latest(run_dir / "checkpoints") is not None)
        seen.append(checkpoint.read_meta(checkpoint.latest(run_dir / "checkpoints"))["step"])
        os.kill(json.loads((run_dir / "placement.json").read_text())[-1]["pid"], signal.SIGKILL)  # server 1

    killer = in_background(kill_server_after_a_checkpoint)
    summary = train(cfg)
    killer.join()
    assert not killer.errors
    assert summary["status"] == "completed" and summary["final_step"] == steps
    first, second = summary["attempts"]
    assert first["outcome"] == "failed" and "parameter server" in first["cause"]
    assert second["info"]["resumed_from_step"] >= seen[0] > 0
    assert [m["step"] for m in read_metrics(cfg.run_dir)] == list(range(1, steps + 1))


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_sigterm_saves_the_servers_and_a_rerun_resumes(ray_cluster, tmp_path: Path, mode: str):
    steps = 60  # the straggler's steps left after 5 outlast the stop's way to it (lines lag a few polls)
    overrides = (
        "run.name=stop",
        "strategy=ps",
        f"strategy.mode={mode}",
        f"trainer.max_steps={steps}",
        "trainer.straggler=1",
        "trainer.straggler_slowdown=20",
    )
    cfg = make_config(tmp_path, *overrides)
    run_dir = Path(cfg.run_dir)

    def preempt() -> None:
        when(lambda: any(m["step"] >= 5 for m in read_metrics(str(run_dir))))
        os.kill(os.getpid(), signal.SIGTERM)  # what `ray job stop` sends the driver

    stopper = in_background(preempt)
    summary = train(cfg)
    stopper.join()
    assert not stopper.errors
    assert summary["status"] == "stopped"
    saved = checkpoint.read_meta(checkpoint.latest(run_dir / "checkpoints"))["step"]
    assert 5 <= saved < steps  # the last step every worker had in the weights when it stopped
    summary = train(make_config(tmp_path, *overrides))
    assert summary["status"] == "completed" and summary["attempts"][0]["info"]["resumed_from_step"] == saved
    assert [m["step"] for m in read_metrics(cfg.run_dir)] == list(range(1, steps + 1))
