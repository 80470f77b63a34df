"""The parameter server: each mode's arithmetic checked exactly on server objects driven in a chosen
order (staleness, Hogwild's shared state and concurrency, EASGD's exchange, backup workers, restore),
and whole runs checked against the training they must equal (DDP, one-process SGD, an uninterrupted
run after a dead server or a stop), their bounds, and their survival of dead workers.

Nothing waits on a fixed time window: runs are pinned with fault.hold_file while a test changes the
world around them, and every wait has a deadline."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import ray
import torch
from conftest import committed_step, final_weights, logged, make_config
from test_fault_tolerance import in_background, when
from torch import nn

from distrain.channel import Channel
from distrain.config import TrainConfig
from distrain.data.corpus import load_tokens, unigram_entropy
from distrain.driver.launch import train
from distrain.driver.validation import validate
from distrain.model.llama import Transformer
from distrain.ps import saved
from distrain.ps.job import ServerJob, WorkerJob
from distrain.ps.server import ParameterServer, elastic_exchange, feasible, load_weights
from distrain.ps.shard import Piece, Slot, as_tensor, split_into_shards
from distrain.ps.worker import PSWorker
from distrain.storage import checkpoint, remote, safeload
from distrain.storage.objectstore import store_for
from distrain.storage.tracking import read_metrics
from distrain.train.optim import lr_at

THREE_WORKERS = ("cluster.num_workers=3", "trainer.global_batch_size=12")
JOIN_S = 30.0  # how long a server call on a thread of its own may take before the test calls it stuck
STEPS = 10
ONE_WORKER = ("cluster.num_workers=1",)
ASYNC_ONE_WORKER = ("strategy=ps", "ps=async", "ps.num_servers=2", *ONE_WORKER)  # AdamW, a tensor split in two
SGD = ("optim=sgd", "optim.lr=0.3", f"trainer.max_steps={STEPS}")
OPTIM = {"sgd": SGD, "adamw": ("optim=adamw", f"trainer.max_steps={STEPS}")}
STRAGGLER = ("fault.straggler=3", "fault.straggler_slowdown=20")  # the tiny model's steps take ~10 ms
# The main job's nano model, batch and schedule (conf/), not the tests' tiny ones, for 60 steps (about
# 0.4 s each here): at 40, async and Hogwild ended at 2.80 and 2.78, above the 2.76 the test asks for;
# at 50 all passed, but Hogwild came within 0.07 of it (2.57 to 2.70 over four runs).
NANO_STEPS = 60
NANO = (
    "model.dim=128",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.ffn_dim=384",
    "trainer.seq_len=128",
    "trainer.global_batch_size=32",
    "trainer.micro_batch_size=8",
    f"trainer.max_steps={NANO_STEPS}",
    "trainer.eval_batches=4",
    "optim.warmup_steps=20",
)
# Hogwild applies one update per worker's gradient, num_workers per global batch: the learning rate
# per update is scaled down by the 2 workers.
PER_UPDATE_LR = {"hogwild": ["optim.lr=1.5e-3"]}


def ps_weights(cfg: TrainConfig) -> dict:
    """The whole model's weights from the run's newest committed parameter-server checkpoint (on an object store,
    fetched from there into the mirror, as a server restored from it would)."""
    model = Transformer(cfg.model, cfg.trainer.seq_len)
    root = Path(cfg.run_dir) / "checkpoints"
    load_weights(
        remote.fetch(store_for(cfg.run_url, cfg.storage), root) if cfg.run_url else checkpoint.latest(root), model
    )
    return model.state_dict()


def assert_close(got: dict, want: dict, tol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=tol, atol=tol, msg=name)


# -- the pieces, without Ray ------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_shards_are_balanced_and_cover_every_element_once():
    params = [("a", torch.zeros(10, 3)), ("b", torch.zeros(7)), ("c", torch.zeros(100)), ("d", torch.zeros(2, 2))]
    shards = split_into_shards(params, 3)
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


@pytest.mark.timeout(30)
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


@pytest.mark.timeout(30)
def test_a_bounded_staleness_turn_is_given_oldest_first():
    assert feasible([3, 4], version=5, bound=2)  # 3 lands at 5 (2 late), 4 at 6 (2 late)
    assert not feasible([3, 3], version=5, bound=2)  # the second 3 would land at 6: 3 late
    assert feasible([], version=9, bound=0)


# -- server objects driven by the test, in a chosen order -------------------------------------------
#
# A ParameterServer is an ordinary object: the test plays the workers, calling pull and push in the
# order it wants. Sync pushes block until their round closes, so those run on threads with a deadline.


@pytest.fixture
def make_server(ray_cluster, tmp_path: Path) -> Callable[..., ParameterServer]:
    """ParameterServer(config of `overrides`, shard `index`), stopped at the end (which releases
    any call a failed test left waiting)."""
    made: list[ParameterServer] = []

    def make(*overrides: str, index: int = 0, resume_from: str | None = None) -> ParameterServer:
        cfg = make_config(tmp_path, "run.name=unit", "strategy=ps", *overrides)
        validate(cfg)
        server = ParameterServer(ServerJob(cfg, resume_from), index)
        made.append(server)
        return server

    yield make
    for server in made:
        server.stop()


def gradient(server: ParameterServer, seed: int) -> torch.Tensor:
    """A made-up gradient of the server's shard, different for every seed."""
    return torch.randn(server.flat.numel(), generator=torch.Generator().manual_seed(seed))


def push(server: ParameterServer, worker: int, step: int, grad: torch.Tensor) -> dict:
    return server.push(worker, step, grad.numpy(), {"worker": worker, "step": step})


def pulled(server: ParameterServer, worker: int, *args) -> int:
    """The version a worker's pull hands it."""
    version, refs, stopped = server.pull(worker, *args)
    assert not stopped and torch.equal(as_tensor(ray.get(refs[0])), server.flat)  # the weights it has
    return version


def on_thread(fn: Callable, *args) -> threading.Thread:
    """fn(*args) on a thread of its own: `result` then gives what it returned."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.box = box
    thread.start()
    return thread


def result(thread: threading.Thread, what: str) -> object:
    thread.join(JOIN_S)
    assert not thread.is_alive(), f"{what} did not return within {JOIN_S:g} s"
    if "error" in thread.box:
        raise thread.box["error"]
    return thread.box["value"]


def lr(server: ParameterServer, step: int) -> float:
    return lr_at(step, server.cfg.optim, server.cfg.trainer.max_steps)


@contextlib.contextmanager
def next_update_held(optimizer: torch.optim.Optimizer) -> Iterator[threading.Event]:
    """The optimizer's next step waits inside, until the block ends, once it has set the event yielded;
    the steps after it run freely: a push held in the middle of its update."""
    entered, release = threading.Event(), threading.Event()
    original = optimizer.step

    def held_step(*args, **kwargs):
        optimizer.step = original
        entered.set()
        assert release.wait(JOIN_S), "never released"
        return original(*args, **kwargs)

    optimizer.step = held_step
    try:
        yield entered
    finally:
        optimizer.step = original
        release.set()


@pytest.mark.timeout(120)  # with the session's Ray cluster start-up
@pytest.mark.parametrize("mode", ["async", "hogwild"])
def test_staleness_is_the_versions_between_a_workers_pull_and_its_update(make_server, mode: str):
    """Three workers pull and push in a chosen order; each gradient's staleness is the number of
    updates applied between the version its worker pulled and the one it was applied to."""
    server = make_server(f"ps={mode}", *THREE_WORKERS, "optim=sgd", "optim.momentum=0")
    want_weights = server.flat.clone()
    # (worker, step, its staleness) for a push, (worker, the version it gets) for a pull.
    script = [
        (0, 0),
        (1, 0),
        (2, 0),
        (0, 1, 0),  # → version 1
        (1, 1, 1),  # pulled 0, applied to 1  → 2
        (0, 2),
        (0, 2, 0),  # → 3
        (2, 1, 3),  # pulled 0, applied to 3  → 4
        (1, 4),
        (2, 4),
        (2, 2, 0),  # → 5
        (1, 5),  # pulled again before pushing: its gradient is computed on the newer weights
        (1, 2, 0),  # → 6
        (0, 6),
        (2, 6),
        (2, 3, 0),  # → 7
        (0, 3, 1),  # → 8
    ]
    seen_version, applied = {}, 0  # the version each worker computes on; the updates applied so far
    for entry in script:
        if len(entry) == 2:
            worker, version = entry
            assert pulled(server, worker) == version == applied
            seen_version[worker] = version
            continue
        worker, step, stale = entry
        grad = gradient(server, 10 * worker + step)
        answer = push(server, worker, step, grad)
        assert stale == applied - seen_version.pop(worker)  # the script itself counts right
        assert answer["applied"] and answer["staleness"] == stale, (entry, answer)
        applied += 1
        assert answer["version"] == server.version == applied
        want_weights.add_(grad, alpha=-lr(server, step))
    assert push(server, 0, 2, gradient(server, 99))["applied"] is False  # a step pushed again counts once
    assert server.version == applied
    assert torch.equal(server.flat, want_weights)  # every applied gradient once, at its step's rate
    records = server.drain()["records"]  # shard 0 hands each record over with its staleness
    assert [(r["worker"], r["step"], r["staleness"]) for r in records] == [e for e in script if len(e) == 3]


class WatchedCondition(threading.Condition):
    """A server's condition that tells the test when a call has started to wait on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waited.set()
        return super().wait(timeout)


@pytest.mark.timeout(120)  # with the session's Ray cluster start-up
def test_bounded_staleness_makes_a_pull_wait_for_its_turn(make_server):
    """max_staleness=1, three workers: a pull that would let a gradient be applied 2 versions late
    waits until a push makes room, then computes on the newer version; no staleness exceeds 1."""
    server = make_server("ps=async", "ps.max_staleness=1", *THREE_WORKERS, "optim=sgd", "optim.momentum=0")
    server.cond = WatchedCondition()

    def blocked_pull(worker: int) -> threading.Thread:
        server.cond.waited.clear()
        thread = on_thread(pulled, server, worker)
        when(lambda: server.cond.waited.is_set() or not thread.is_alive(), timeout_s=JOIN_S)
        assert thread.is_alive() and server.cond.waited.is_set(), f"worker {worker}'s pull did not wait: {thread.box}"
        return thread

    def pushed(worker: int, step: int) -> int:
        answer = push(server, worker, step, gradient(server, 10 * worker + step))
        assert answer["applied"]
        return answer["staleness"]

    assert pulled(server, 0) == pulled(server, 1) == 0  # their gradients land at versions 0 and 1 at the latest
    third = blocked_pull(2)  # it could land at 2: two versions late
    assert pushed(1, 1) == 0  # → version 1
    assert result(third, "worker 2's pull once worker 1 pushed") == 1
    again = blocked_pull(1)  # 0, 1, 1 in flight at version 1: the last would land at 3
    assert pushed(0, 1) == 1  # → version 2
    assert result(again, "worker 1's pull once worker 0 pushed") == 2
    assert [pushed(2, 1), pushed(1, 2)] == [1, 1]
    assert server.version == 4


@pytest.mark.timeout(120)  # with the session's Ray cluster start-up
def test_hogwild_workers_share_one_optimizer_state(make_server):
    """AdamW's moments and step count are one state for the shard, whichever worker's slot applies
    a gradient: five pushes from two workers equal five steps of one optimizer."""
    server = make_server("ps=hogwild", "cluster.num_workers=2")  # AdamW: state that matters
    assert len(server.slots) == 2
    ref_flat = server.flat.clone()
    ref = Slot(ref_flat, server.pieces, server.cfg.optim)
    for worker, step in [(0, 1), (1, 1), (1, 2), (0, 2), (1, 3)]:
        grad = gradient(server, 10 * worker + step)
        assert push(server, worker, step, grad)["applied"]
        ref.step(grad.clone(), lr(server, step))
    assert torch.equal(server.flat, ref_flat)


@pytest.mark.timeout(120)  # with the session's Ray cluster start-up
def test_hogwild_pushes_run_concurrently(make_server):
    """One worker's update is held inside its optimizer step; another worker's push still goes
    through meanwhile (no lock serialises them), and both updates land."""
    server = make_server("ps=hogwild", "cluster.num_workers=2")
    ref_flat = server.flat.clone()
    ref = Slot(ref_flat, server.pieces, server.cfg.optim)
    first = gradient(server, 1)
    push(server, 0, 1, first)  # the very first update creates the shared state (under the lock)
    ref.step(first.clone(), lr(server, 1))
    assert pulled(server, 0) == pulled(server, 1) == 1

    slow, fast = gradient(server, 2), gradient(server, 3)
    with next_update_held(server.slots[0].optimizer) as entered:
        held = on_thread(push, server, 0, 2, slow)
        assert entered.wait(JOIN_S), "worker 0's push never reached its optimizer step"
        other = on_thread(push, server, 1, 1, fast)
        answer = result(other, "worker 1's push while worker 0's was inside its update")
        assert held.is_alive()  # still inside its update: the two ran at once
        assert answer["applied"] and answer["staleness"] == 0 and answer["version"] == 2
    answer = result(held, "worker 0's push once released")
    assert answer["applied"] and answer["staleness"] == 1 and answer["version"] == 3  # worker 1's came first
    ref.step(fast.clone(), lr(server, 1))
    ref.step(slow.clone(), lr(server, 2))
    assert torch.equal(server.flat, ref_flat)


@pytest.mark.timeout(120)  # with the session's Ray cluster start-up
def test_a_hogwild_step_pushed_twice_at_once_counts_once(make_server):
    """A replaced worker's last push may still be running on the server when its successor pushes the
    same step: while the first is inside its update, the second is not applied."""
    server = make_server("ps=hogwild", "cluster.num_workers=2")
    push(server, 0, 1, gradient(server, 1))  # the first update (under the lock) is done
    with next_update_held(server.slots[1].optimizer) as entered:
        first = on_thread(push, server, 1, 1, gradient(server, 11))
        assert entered.wait(JOIN_S), "the first push never reached its optimizer step"
        again = result(on_thread(push, server, 1, 1, gradient(server, 12)), "the same step pushed again")
        assert again["applied"] is False
    assert result(first, "the first push once released")["applied"]
    assert server.version == 2 and server.next_step(1) == 2


@pytest.mark.timeout(180)
def test_an_easgd_worker_moves_by_the_difference_the_exchange_returns(ray_cluster, tmp_path: Path, monkeypatch):
    """PSWorker.exchange against two real server actors: the worker's weights become
    x − α(x − x̃) and the centre x̃ + α(x − x̃), shard by shard (a tensor is split between them)."""
    alpha = 0.25
    cfg = make_config(tmp_path, "run.name=easgd", "strategy=ps", "ps=easgd", "ps.num_servers=2", f"ps.alpha={alpha}")
    layout = validate(cfg)
    servers = [ray.remote(ParameterServer).options(max_concurrency=4).remote(ServerJob(cfg), k) for k in range(2)]
    try:
        monkeypatch.setenv("RANK", "0")
        worker = PSWorker(WorkerJob(cfg, layout, tuple(servers)), Channel())
        params = list(worker.model.parameters())
        assert worker.pull(0) == 0
        centre = nn.utils.parameters_to_vector(params).detach().clone()
        x = centre + torch.linspace(-1.0, 1.0, centre.numel())  # as if trained locally
        nn.utils.vector_to_parameters(x.clone(), params)  # (the parameters become views of what it is given)
        worker.exchange(4, [])
        diff = (x - centre).mul_(alpha)
        assert torch.equal(nn.utils.parameters_to_vector(params).detach(), x - diff)  # x_i ← x_i − d
        worker.versions = [-1, -1]  # fetch every shard again: the centres the servers now hold
        assert worker.pull(1) == 1
        assert torch.equal(nn.utils.parameters_to_vector(params).detach(), centre + diff)  # x̃ ← x̃ + d
    finally:
        for server in servers:
            ray.kill(server)


@pytest.mark.timeout(120)  # with the session's Ray cluster start-up
def test_the_easgd_server_counts_an_exchange_once(make_server):
    server = make_server("ps=easgd", "ps.alpha=0.5")
    centre = server.flat.clone()
    worker = centre + torch.linspace(-1, 1, centre.numel())
    answer = server.exchange(0, 4, worker.numpy())
    assert torch.equal(torch.from_numpy(answer["diff"]), (worker - centre).mul_(0.5))
    assert server.exchange(0, 4, worker.numpy())["applied"] is False  # the same step twice counts once
    assert server.version == 1


@pytest.mark.timeout(120)  # with the session's Ray cluster start-up
def test_a_sync_round_with_a_backup_worker_applies_exactly_the_first_gradients(make_server):
    """Three workers, one backup: each round averages the first two gradients to arrive; the third
    (arriving after the round closed, or after it was applied) never reaches the weights, and its
    record says it was dropped."""
    server = make_server(*THREE_WORKERS, "ps.backup_workers=1", "optim=sgd", "optim.momentum=0", "optim.grad_clip=0")
    want = server.flat.clone()
    grads = {(w, s): gradient(server, 10 * w + s) for w in range(3) for s in (1, 2)}

    def round_of(step: int, first: list[int], late: int, late_after_apply: bool) -> None:
        pushes = [on_thread(push, server, w, step, grads[w, step]) for w in first]
        answers = [result(t, f"worker {w}'s push of step {step}") for w, t in zip(first, pushes, strict=True)]
        mean = torch.stack([grads[w, step] for w in sorted(first)]).sum(0).div_(2)
        assert all(a["applied"] and a["norm_sq"] == float(mean.double().pow(2).sum()) for a in answers)
        norm = answers[0]["norm_sq"] ** 0.5
        if not late_after_apply:  # closed, not yet applied
            assert result(on_thread(push, server, late, step, grads[late, step]), "the late push")["applied"] is False
        assert pulled(server, first[0], step, (step, norm)) == step  # the next pull applies the round
        if late_after_apply:
            assert result(on_thread(push, server, late, step, grads[late, step]), "the late push")["applied"] is False
        want.add_(mean, alpha=-lr(server, step))

    round_of(1, [1, 0], late=2, late_after_apply=False)
    round_of(2, [2, 0], late=1, late_after_apply=True)
    assert torch.equal(server.flat, want)
    records = {(r["worker"], r["step"]): r["applied"] for r in server.drain()["records"]}
    assert records == {(0, 1): True, (1, 1): True, (2, 1): False, (0, 2): True, (2, 2): True, (1, 2): False}


@pytest.mark.timeout(120)  # with the session's Ray cluster start-up
@pytest.mark.parametrize("mode", ["async", "hogwild", "sync"])
def test_a_restored_server_goes_on_exactly_as_the_saved_one(make_server, tmp_path: Path, mode: str):
    """A shard saved mid-training (AdamW: weights, moments, step counts, version, applied steps) and
    a new one loaded from the save take the same next gradient to the same weights, bit for bit."""
    overrides = (f"ps={mode}", "cluster.num_workers=2")
    saved = make_server(*overrides)

    def train_a_little(server: ParameterServer, steps: list[int]) -> None:
        for step in steps:
            if mode == "sync":
                pushes = [on_thread(push, server, w, step, gradient(server, 10 * w + step)) for w in (0, 1)]
                norm = sum(result(t, "a sync push")["norm_sq"] for t in pushes) ** 0.5
                assert pulled(server, 0, step, (step, norm)) == step
            else:
                for worker in (0, 1):
                    assert push(server, worker, step, gradient(server, 10 * worker + step))["applied"]

    train_a_little(saved, [1, 2])
    meta = saved.save("saved")  # a staging directory of the run's checkpoints
    folder = Path(saved.cfg.run_dir) / "checkpoints" / "saved"
    assert meta["applied"] == {0: 2, 1: 2}  # the last step of each worker the saved weights hold
    state = torch.load(folder / meta["file"], weights_only=False)  # the test's own file: read whole
    assert safeload.unplain_leaves(state, allowed=[Piece]) == [] and state["optim"]["state"]  # moments and all
    restored = make_server(*overrides, resume_from=str(folder))
    assert restored.version == saved.version == (2 if mode == "sync" else 4)
    assert torch.equal(restored.flat, saved.flat)
    assert [restored.next_step(w) for w in (0, 1)] == [3, 3]
    if mode != "sync":  # a step the save holds, pushed again (a worker resuming behind a shard), counts once
        assert push(restored, 1, 2, gradient(restored, 12))["applied"] is False
    for server in (saved, restored):
        train_a_little(server, [3, 4])
    assert restored.version == saved.version
    assert torch.equal(restored.flat, saved.flat)


# -- whole runs -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ddp(ray_cluster, tmp_path_factory) -> Callable[[str], TrainConfig]:
    """DDP's run with optimizer `name` (SGD with momentum, or AdamW), run once per module."""
    runs: dict[str, TrainConfig] = {}

    def run(name: str) -> TrainConfig:
        if name not in runs:
            cfg = make_config(
                tmp_path_factory.mktemp(f"ddp-{name}"), "run.name=ddp", "cluster.num_workers=4", *OPTIM[name]
            )
            assert train(cfg)["status"] == "completed"
            runs[name] = cfg
        return runs[name]

    return run


@pytest.mark.timeout(300)
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_sync_is_ddp(ddp, tmp_path: Path, optim: str):
    """Two shards (a tensor split between them), four workers: the same training as DDP, with the
    servers' optimizer (SGD with momentum, AdamW with its decayed and undecayed groups) as DDP's."""
    cfg = make_config(
        tmp_path, "run.name=sync", "strategy=ps", "ps.num_servers=2", "cluster.num_workers=4", *OPTIM[optim]
    )
    assert train(cfg)["status"] == "completed"
    want = ddp(optim)
    for key in ("loss", "grad_norm"):
        got, expected = logged(cfg, key), logged(want, key)
        assert sorted(got) == list(range(1, STEPS + 1))
        for step in got:
            assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-5), f"{key} at step {step}"
    assert_close(ps_weights(cfg), final_weights(want), 1e-5)
    assert all(m["dropped"] == 0 and m["workers"] == 4 for m in read_metrics(cfg.run_dir))


@pytest.mark.timeout(300)
def test_the_next_run_of_the_same_shape_takes_the_servers_and_they_start_over(ddp, tmp_path: Path):
    """cluster.reuse_workers: a run that ended well leaves its servers to the next run of the driver with
    as many servers, workers and CPUs. The same processes serve it, and nothing of the first run is left
    in them: the second run, AdamW after SGD, is still DDP's AdamW training."""
    shape = ("strategy=ps", "ps.num_servers=2", "cluster.num_workers=4")
    runs = [make_config(tmp_path, f"run.name={optim}", *shape, *OPTIM[optim]) for optim in ("sgd", "adamw")]
    for cfg in runs:
        assert train(cfg)["status"] == "completed"
    pids = [server_pids(Path(cfg.run_dir)) for cfg in runs]
    assert len(pids[0]) == 2 and pids[0] == pids[1]
    want = ddp("adamw")
    got, expected = logged(runs[1]), logged(want)
    assert got.keys() == expected.keys() and all(got[k] == pytest.approx(expected[k], abs=1e-5) for k in got)
    assert_close(ps_weights(runs[1]), final_weights(want), 1e-5)


@pytest.mark.timeout(240)
def test_async_with_one_worker_is_one_process_training(ray_cluster, tmp_path: Path):
    """One async worker's gradients, applied by two shards with AdamW as they come, are the
    one-process run's training, to the last bit."""
    one = make_config(tmp_path, "run.name=one", *ONE_WORKER, f"trainer.max_steps={STEPS}")
    assert train(one)["status"] == "completed"
    cfg = make_config(tmp_path, "run.name=async", *ASYNC_ONE_WORKER, f"trainer.max_steps={STEPS}")
    assert train(cfg)["status"] == "completed"
    assert sorted(logged(cfg)) == list(range(1, STEPS + 1))
    assert logged(cfg) == logged(one) and logged(cfg, "grad_norm") == logged(one, "grad_norm")  # exactly
    assert_close(ps_weights(cfg), final_weights(one), 0.0)
    assert {m["staleness_max"] for m in read_metrics(cfg.run_dir)} == {0}


def four_workers_one_straggler(tmp_path: Path, name: str, steps: int, *overrides: str) -> list[dict]:
    """A parameter-server run of 4 workers, rank 3 twenty times slower, trained to its end: its metrics
    lines, each step logged exactly once."""
    cfg = make_config(
        tmp_path,
        f"run.name={name}",
        "strategy=ps",
        *overrides,
        "cluster.num_workers=4",
        f"trainer.max_steps={steps}",
        *STRAGGLER,
    )
    assert train(cfg)["status"] == "completed"
    lines = read_metrics(cfg.run_dir)
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    return lines


@pytest.mark.timeout(240)
def test_bounded_staleness_is_never_exceeded(ray_cluster, tmp_path: Path):
    """Four async workers, one 20 times slower, max_staleness=1: every step is logged once and no
    gradient was applied more than 1 version late. (Whether unbounded workers would have been later
    depends on how far apart the workers start on a loaded machine: the unit test above shows the
    bound at work, deterministically.)"""
    lines = four_workers_one_straggler(tmp_path, "bounded", 15, "ps=async", "ps.max_staleness=1")
    assert all(m["workers"] == 4 for m in lines)
    assert max(m["staleness_max"] for m in lines) <= 1


@pytest.mark.timeout(240)
def test_backup_workers_apply_the_first_gradients_of_each_step(ray_cluster, tmp_path: Path):
    steps = 12
    lines = four_workers_one_straggler(tmp_path, "backup", steps, "ps.backup_workers=1")
    assert all(m["workers"] - m["dropped"] == 3 for m in lines)  # each round took exactly 4 − 1
    unused = sum(m["dropped"] for m in lines) + 4 * steps - sum(m["workers"] for m in lines)  # dropped or skipped
    assert unused >= steps // 2  # the rounds did not wait for the straggler


# Sync is DDP step for step (test_sync_is_ddp) and async is one-process training plus a staleness that is
# checked exactly (test_async_with_one_worker_is_one_process_training and
# test_staleness_is_the_versions_between_a_workers_pull_and_its_update): what is left
# to show end to end is that the two modes with an update rule of their own learn.
@pytest.mark.timeout(420)
@pytest.mark.parametrize("mode", ["hogwild", "easgd"])
def test_hogwild_and_easgd_train_the_nano_model_well_below_the_unigram_baseline(ray_cluster, tmp_path: Path, mode):
    cfg = make_config(tmp_path, f"run.name={mode}", "strategy=ps", f"ps={mode}", *NANO, *PER_UPDATE_LR.get(mode, []))
    summary = train(cfg)
    baseline = unigram_entropy(load_tokens(None))
    assert summary["status"] == "completed" and summary["final_step"] == NANO_STEPS
    # The untrained model's loss is ln 256 = 5.55; a model of byte frequencies alone, 3.25 (the baseline).
    # Seen after 60 steps: sync 2.44, EASGD 2.49, Hogwild 2.51 to 2.60, async 2.57 to 2.64 (async and Hogwild
    # vary from run to run with the order their updates land in), against the 2.76 it takes.
    assert summary["final_val_loss"] < 0.85 * baseline, f"{mode}: {summary['final_val_loss']:.3f} vs {baseline:.3f}"


def placed(run_dir: Path) -> list[dict]:
    """The current attempt's actors: workers (with their rank) and servers (with their index)."""
    return json.loads((run_dir / "placement.json").read_text())


def server_pids(run_dir: Path) -> set[int]:
    return {e["pid"] for e in placed(run_dir) if "server" in e}


@pytest.mark.timeout(300)
def test_a_dead_async_worker_is_replaced_while_the_others_go_on(ray_cluster, tmp_path: Path):
    """Worker 1 is killed while the run is held after step 5; the replacement resumes after its last
    applied step and the others never restart: every step is logged once with all three workers. The
    run is long enough that it is still going when the killer thread, which shares the driver's GIL on a
    busy machine, sees step 5 (with 20 steps, a CI run once finished first and the killer waited in vain)."""
    steps = 80
    hold = tmp_path / "hold"
    cfg = make_config(
        tmp_path,
        "run.name=kill",
        "strategy=ps",
        "ps=async",
        *THREE_WORKERS,
        f"trainer.max_steps={steps}",
        "fault.straggler=1",  # the victim is the slowest: when step 5 is logged, it is at 6 or so
        "fault.straggler_slowdown=10",
        f"fault.hold_file={hold}",
    )
    run_dir = Path(cfg.run_dir)
    killed = {}

    def kill_worker_1() -> None:
        when(lambda: any(m["step"] >= 5 for m in read_metrics(str(run_dir))))
        hold.touch()  # every worker waits before its next step
        assert max(m["step"] for m in read_metrics(str(run_dir))) < steps, "the run ended before the kill"
        (victim,) = [e for e in placed(run_dir) if e.get("rank") == 1]
        os.kill(victim["pid"], signal.SIGKILL)
        killed.update(victim)
        when(lambda: [e["pid"] for e in placed(run_dir) if e.get("rank") == 1] not in ([], [victim["pid"]]))
        hold.unlink()

    killer = in_background(kill_worker_1)
    summary = train(cfg)
    killer.join(JOIN_S)
    assert not killer.is_alive() and not killer.errors, killer.errors
    assert summary["status"] == "completed" and summary["final_step"] == steps
    assert len(summary["attempts"]) == 1 and summary["restarts"] == 1  # one worker replaced, the run never restarted
    (replacement,) = summary["replacements"]
    assert replacement["worker"] == 1 and "ActorDiedError" in replacement["cause"]
    assert f"pid {killed['pid']}" in replacement["cause"]
    lines = read_metrics(cfg.run_dir)
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    assert all(m["workers"] == 3 for m in lines)  # no step of the victim lost or doubled


# -- restores: the interrupted run ends as the uninterrupted one ---------------------------------------
#
# sync (two workers) and async with one worker are deterministic, so a run whose servers are restored
# from a checkpoint must end with the uninterrupted run's weights and metrics, bit for bit. AdamW, so
# that the optimizer state has to come back too. The first part of a run is a run of 4 steps; the
# interrupted part resumes from its checkpoint held (fault.hold_file) while the test kills a server
# or stops the driver.
#
# sync: the schedule's length is fixed (optim.decay_steps), so the first part is the first 4 steps of
# the uninterrupted parameter-server run. async: the first part keeps its own 4-step schedule, so a
# run that did not restore the servers, redoing every step under the 12-step schedule, would end
# elsewhere; the uninterrupted reference is then the one-process run of the same two parts, restored
# by collective training's own checkpoints (async with one worker is one-process training, above).

RESTORE_STEPS = 12
RESTORED = {  # without trainer.max_steps
    "sync": (
        "strategy=ps",
        "ps.num_servers=2",
        "cluster.num_workers=2",
        "checkpoint.interval=4",
        f"optim.decay_steps={RESTORE_STEPS}",
    ),
    "async": (*ASYNC_ONE_WORKER, "checkpoint.interval=4"),
}


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, tmp_path_factory) -> Callable[[str], tuple[dict, dict]]:
    """The final weights and the logged (loss, grad_norm) of step → of the uninterrupted run for
    RESTORED[mode], run once per module."""
    runs: dict[str, tuple[dict, dict]] = {}

    def run(mode: str) -> tuple[dict, dict]:
        if mode not in runs:
            storage = tmp_path_factory.mktemp(f"uninterrupted-{mode}")
            if mode == "sync":
                cfg = make_config(storage, "run.name=sync", *RESTORED[mode], f"trainer.max_steps={RESTORE_STEPS}")
                assert train(cfg)["restarts"] == 0
                weights = ps_weights(cfg)
            else:  # the one-process run of the same two parts
                for steps in (4, RESTORE_STEPS):
                    cfg = make_config(
                        storage, "run.name=one", *ONE_WORKER, "checkpoint.interval=4", f"trainer.max_steps={steps}"
                    )
                    assert train(cfg)["status"] == "completed"
                weights = final_weights(cfg)
            runs[mode] = weights, {m["step"]: (m["loss"], m["grad_norm"]) for m in read_metrics(cfg.run_dir)}
        return runs[mode]

    return run


def assert_same_training(cfg: TrainConfig, reference: tuple[dict, dict]) -> None:
    want_weights, want_lines = reference
    got = ps_weights(cfg)
    assert got.keys() == want_weights.keys()
    different = [name for name in want_weights if not torch.equal(got[name], want_weights[name])]
    assert different == [], f"weights differ from the uninterrupted run: {different}"
    lines = {m["step"]: (m["loss"], m["grad_norm"]) for m in read_metrics(cfg.run_dir)}
    assert [m["step"] for m in read_metrics(cfg.run_dir)] == list(range(1, RESTORE_STEPS + 1))  # each step once
    assert lines == want_lines  # with the loss and gradient norm the training had, to the last bit


def first_four_steps(storage: Path | str, overrides: tuple[str, ...]) -> None:
    """The run's first part, a run of 4 steps: lines 1..4 and a checkpoint of step 4 (a run of 4
    steps, because where the checkpoint of an unfinished run lands depends on when the driver looks:
    the servers save what they hold then). Its placement.json is removed (on an object store, there too):
    the next run writes its own once its servers are up and restored (kept ones, cluster.reuse_workers, or new)."""
    cfg = make_config(storage, *overrides, "trainer.max_steps=4")
    assert train(cfg)["status"] == "completed"
    run_dir = Path(cfg.run_dir)
    if cfg.run_url:
        store = store_for(cfg.run_url, cfg.storage)
        assert remote.latest_meta(store)[1]["step"] == 4
        store.remove("placement.json")
    else:
        assert committed_step(run_dir) == 4
    assert [m["step"] for m in read_metrics(cfg.run_dir)] == [1, 2, 3, 4]
    assert not (run_dir / "attempts" / "002-placement.json").exists()
    (run_dir / "placement.json").unlink()


@pytest.mark.timeout(420)
# sync on the object store covers sync on a folder too (the same engine; a folder's restore is async's here)
@pytest.mark.parametrize("mode, where", [("async", "folder"), ("sync", "store")])
def test_a_dead_server_is_restored_from_the_last_checkpoint(
    uninterrupted, tmp_path: Path, mode: str, where: str, request
):
    """The run resumes from its checkpoint of step 4, held; server 1 is SIGKILLed; the hold is lifted
    once the next attempt is placed. That attempt restores both servers from the checkpoint again, and
    the run ends as the uninterrupted one on a local folder. On an object store (run.storage=s3://…), each
    server uploads its shard and the driver commits the checkpoint there; a restore fetches it from there."""
    hold = tmp_path / "hold"
    overrides = ("run.name=server", *RESTORED[mode], f"fault.hold_file={hold}", f"storage.cache_dir={tmp_path}")
    storage = request.getfixturevalue("s3").url("ps") if where == "store" else tmp_path
    first_four_steps(storage, overrides)
    cfg = make_config(storage, *overrides, f"trainer.max_steps={RESTORE_STEPS}")
    run_dir = Path(cfg.run_dir)
    if where == "store":  # the driver's mirror holds the commit's record (meta.json, the marker), no server's shard
        assert_committed_on_the_store(cfg, 4)
        assert {p.name for p in (run_dir / "checkpoints").rglob("*")} == {"step_00000004", "meta.json", "COMMITTED"}

    def kill_server_1() -> None:
        when((run_dir / "placement.json").exists)  # the first attempt's servers are up, restored
        (server,) = [e for e in placed(run_dir) if e.get("server") == 1]
        os.kill(server["pid"], signal.SIGKILL)
        when((run_dir / "attempts" / "002-placement.json").exists)  # the next attempt's servers are up
        hold.unlink()

    hold.touch()  # every worker waits before its first step
    killer = in_background(kill_server_1)
    summary = train(cfg)
    killer.join(JOIN_S)
    assert not killer.is_alive() and not killer.errors, killer.errors
    assert summary["status"] == "completed" and summary["final_step"] == RESTORE_STEPS
    first, second = summary["attempts"]
    assert first["outcome"] == "failed" and "parameter server" in first["cause"], first
    assert first["info"]["resumed_from_step"] == second["info"]["resumed_from_step"] == 4
    if mode == "sync":  # a version per step: the servers did load the checkpoint (redoing from 0 ends the same)
        assert first["info"]["servers_version"] == second["info"]["servers_version"] == 4
    assert not (run_dir / "metrics.superseded.jsonl").exists()  # held: the failed attempt logged nothing
    if where == "store":
        assert_committed_on_the_store(cfg, RESTORE_STEPS)
    assert_same_training(cfg, uninterrupted(mode))


def assert_committed_on_the_store(cfg: TrainConfig, step: int) -> None:
    """The newest checkpoint on the store is `step`'s, whole there: each server's shard and meta.json, with the marker
    that lists them."""
    store, name = store_for(cfg.run_url, cfg.storage), f"step_{step:08d}"
    found = remote.on_store(store)
    assert next(iter(found)) == name and remote.problem_on_store(store, name, found[name]) is None
    assert sorted(found[name]) == ["COMMITTED", "meta.json", "server_000.pt", "server_001.pt"]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigterm_saves_the_servers_and_a_rerun_resumes_exactly(uninterrupted, tmp_path: Path, mode: str):
    """SIGTERM while the run, resumed from its checkpoint of step 4, is held: the servers save what
    they hold (async: the one step the stop let through; sync: that step's round is never applied) and
    the rerun with the same run.name resumes there and ends as the uninterrupted run."""
    hold = tmp_path / "hold"
    overrides = ("run.name=stop", *RESTORED[mode], f"fault.hold_file={hold}", f"trainer.max_steps={RESTORE_STEPS}")
    first_four_steps(tmp_path, overrides[:-1])  # without the 12 steps
    cfg = make_config(tmp_path, *overrides)
    run_dir = Path(cfg.run_dir)

    def preempt() -> None:
        when((run_dir / "placement.json").exists)  # the servers are up, restored
        os.kill(os.getpid(), signal.SIGTERM)  # what `ray job stop` sends the driver

    hold.touch()
    stopper = in_background(preempt)
    summary = train(cfg)
    stopper.join(JOIN_S)
    assert not stopper.is_alive() and not stopper.errors, stopper.errors
    assert summary["status"] == "stopped" and [a["outcome"] for a in summary["attempts"]] == ["stopped"]
    saved = committed_step(run_dir)
    # The stop reaches a worker either held before step 5 (it then does step 5) or before its first pull.
    assert saved in ((4, 5) if mode == "async" else (4,))
    hold.unlink()
    summary = train(make_config(tmp_path, *overrides))
    assert summary["status"] == "completed" and summary["restarts"] == 0
    assert summary["attempts"][0]["info"]["resumed_from_step"] == saved
    if mode == "sync":
        assert summary["attempts"][0]["info"]["servers_version"] == saved  # loaded, not trained again from 0
    assert_same_training(cfg, uninterrupted(mode))


def test_a_server_restored_from_a_store_that_lost_the_checkpoint_is_refused_in_one_line(tmp_path: Path):
    """A checkpoint the driver chose on the store and gone by the time a server fetches it: the server's restore
    names the store and the step, instead of loading nothing (a file:// store: no server needed)."""
    cfg = make_config(tmp_path, f"run.storage=file://{tmp_path}/store", "run.name=r", f"storage.cache_dir={tmp_path}")
    gone = Path(cfg.run_dir) / "checkpoints" / "step_00000004"
    with pytest.raises(safeload.DamagedCheckpointError, match=r"no longer holds the checkpoint of step 4$"):
        saved.restored(cfg, str(gone))


def test_a_servers_file_whose_upload_failed_is_not_left_on_its_node(tmp_path: Path):
    """A server's upload of its saved shard fails (the store cannot take the object): the checkpoint will not commit,
    and its file and the staging directory, never loaded, go from the node's mirror as after an upload."""
    cfg = make_config(
        tmp_path, f"run.storage=file://{tmp_path}/store", "run.name=r", f"storage.cache_dir={tmp_path}",
        "storage.retries=1",
    )  # fmt: skip
    staging = Path(cfg.run_dir) / "checkpoints" / ".saving-0"
    staging.mkdir(parents=True)
    (staging / "server_0.pt").write_bytes(b"shard")
    blocked = tmp_path / "store" / "r" / "checkpoints" / "step_00000004"
    blocked.parent.mkdir(parents=True)
    blocked.write_text("a file where the checkpoint's folder would go")
    why = saved.upload(cfg, staging.name, "server_0.pt", "checkpoints/step_00000004")
    assert why and "step_00000004" in why
    assert not staging.exists()
