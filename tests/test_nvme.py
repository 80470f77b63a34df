"""NVMe offload: AdamW's moments in files, streamed through a few host buffers, and nothing else changed:
the same update bit for bit as CPU offload, the same checkpoints, resumable with or without it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import logged, make_config

from distrain.config import ConfigError
from distrain.driver.launch import train
from distrain.driver.validation import validate
from distrain.storage import checkpoint, directio
from distrain.train.nvme import NVMeAdamW, Scratch

POOL = int(1.5 * 2**20)  # the smallest pool: chunks of 64 Ki elements, so a small model spans several
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "foreach": True}
SHAPES = [(1000, 37), (513,), (64, 64), (300, 700), (5,), (200_000,)]  # pieces across chunk boundaries


def groups(params: list[torch.Tensor]) -> list[dict]:
    return [{"params": params[:3], "weight_decay": 0.1}, {"params": params[3:], "weight_decay": 0.0}]


def slowed(move, seconds: float):
    """A disk whose reads or writes start late: a buffer reused before its write finished, or updated
    before its read did, then holds other bytes by the time they happen."""

    def late(fd: int, view: memoryview, offset: int) -> None:
        time.sleep(seconds)
        move(fd, view, offset)

    return late


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("overlap", "slow"),
    [(True, None), (False, None), (True, "read_into"), (True, "write_from")],
    ids=["overlapped", "serial", "overlapped-slow-reads", "overlapped-slow-writes"],
)
def test_streamed_adamw_is_adamw_bit_for_bit(overlap: bool, slow: str | None, tmp_path: Path, monkeypatch):
    """Three steps (one leaving a parameter without a gradient) of torch's AdamW on whole tensors and of
    NVMeAdamW over 7 chunks: equal parameters, moments and steps; AdamW's state loaded into a new one
    continues equally; the files go when it closes. On a slowed disk, the overlapped stream's waits are
    what keeps a buffer's bytes right."""
    if slow:
        monkeypatch.setattr(directio, slow, slowed(getattr(directio, slow), 0.01))
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=generator) for s in SHAPES]
    grads = [[torch.randn(s, generator=generator) for s in SHAPES] for _ in range(3)]
    grads[1][4] = None
    plain = [p.clone() for p in start]
    adamw = torch.optim.AdamW(groups(plain), **ADAMW)
    streamed = [p.clone() for p in start]
    nvme = NVMeAdamW(groups(streamed), Scratch(tmp_path, "run/rank_0", POOL, overlap), **ADAMW)
    assert nvme.stream.chunks == 7

    def step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], step_grads: list) -> None:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = None if g is None else g.clone()
        optimizer.step()

    for step_grads in grads:
        step(adamw, plain, step_grads)
        step(nvme, streamed, step_grads)
    assert all(torch.equal(a, b) for a, b in zip(plain, streamed, strict=True))
    saved = nvme.state_dict()["state"]
    for i, p in enumerate(plain):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(adamw.state[p][key], saved[i][key]), (i, key)
    del saved

    resumed = [p.clone() for p in plain]
    loaded = NVMeAdamW(groups(resumed), Scratch(tmp_path, "run/rank_1", POOL, overlap), **ADAMW)
    loaded.load_state_dict(adamw.state_dict())
    step(adamw, plain, grads[0])
    step(loaded, resumed, grads[0])
    assert all(torch.equal(a, b) for a, b in zip(plain, resumed, strict=True))
    nvme.close()
    loaded.close()
    assert not (tmp_path / "run").exists()


def checkpoint_tensors(run_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of the run's newest committed checkpoint (weights and optimizer state), by key."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = checkpoint.latest(Path(run_dir) / "checkpoints")
    out = Path(run_dir) / "flat.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp_to_torch_save(path, out)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        elif torch.is_tensor(value):
            flat[prefix] = value

    walk("", torch.load(out, weights_only=True))
    return flat


STEPS = 6
# nano's width: 460 k parameters a rank, so its moments stream in 8 chunks through the smallest pool.
COMMON = (
    f"trainer.max_steps={STEPS}",
    f"optim.decay_steps={STEPS}",  # the same schedule for a run stopped half-way and resumed
    "model.dim=128",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.ffn_dim=384",
    "cluster.num_workers=2",
    "checkpoint.interval=3",
    "checkpoint.keep=4",
)


def nvme(path: Path) -> tuple[str, ...]:
    return ("strategy=nvme", f"strategy.nvme_path={path}", f"strategy.nvme_buffer_mb={POOL / 2**20}")


@pytest.fixture(scope="module")
def cpu_offload(ray_cluster, tmp_path_factory):
    cfg = make_config(tmp_path_factory.mktemp("cpu"), "run.name=cpu", "strategy=offload", *COMMON)
    assert train(cfg)["status"] == "completed"
    return cfg


@pytest.mark.timeout(300)
def test_nvme_offload_trains_as_cpu_offload_bit_for_bit(cpu_offload, tmp_path: Path):
    """Same layout and steps: every loss and gradient norm, and every weight and moment of the final
    checkpoint, equal to CPU offload's; the scratch files are gone when the run ends."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    cfg = make_config(tmp_path, "run.name=nvme", *COMMON, *nvme(scratch))
    assert train(cfg)["status"] == "completed"
    for key in ("loss", "grad_norm"):
        assert logged(cfg, key) == logged(cpu_offload, key), key
    want, got = checkpoint_tensors(cpu_offload.run_dir), checkpoint_tensors(cfg.run_dir)
    assert sorted(got) == sorted(want) and any(".exp_avg_sq" in k for k in got)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    assert os.listdir(scratch) == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("order", ["nvme_then_none", "none_then_nvme"])
def test_resumes_across_nvme_and_no_offload(order: str, cpu_offload, tmp_path: Path):
    """Three steps with one, three from its checkpoint with the other: the run goes on as CPU offload's
    did, bit for bit (both sides update on the CPU with the same kernels)."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    plans = [nvme(scratch), ("strategy=zero3",)]
    if order == "none_then_nvme":
        plans.reverse()
    for steps, overrides in zip((STEPS // 2, STEPS), plans, strict=True):
        cfg = make_config(tmp_path, f"run.name={order}", *COMMON, *overrides, f"trainer.max_steps={steps}")
        assert train(cfg)["status"] == "completed"
    cfg = make_config(tmp_path, f"run.name={order}", *COMMON)
    for key in ("loss", "grad_norm"):
        assert logged(cfg, key) == logged(cpu_offload, key), key
    assert os.listdir(scratch) == []


@pytest.mark.timeout(300)
def test_a_rank_killed_mid_run_resumes_from_the_checkpoint_and_ends_bit_for_bit(cpu_offload, tmp_path: Path):
    """SIGKILL a rank once step 3's checkpoint has committed: its scratch files are left behind, the committed
    checkpoint is untouched, the next attempt resumes from it (removing the dead process's files) and the run
    ends as CPU offload's did; nothing is left in nvme_path."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    # Rank 1 a straggler: steps 4-6 take a second or so, time enough to kill it in one of them.
    overrides = (*COMMON, *nvme(scratch), "fault.straggler=1", "cluster.restart_backoff_s=0")
    cfg = make_config(tmp_path, "run.name=killed", *overrides)
    run_dir = Path(cfg.run_dir)
    committed = checkpoint.step_dir(run_dir / "checkpoints", 3) / checkpoint.COMMIT_MARKER
    killed = []

    def kill_rank_1() -> None:
        deadline = time.monotonic() + 120
        while not committed.exists() and time.monotonic() < deadline:
            time.sleep(0.002)
        ranks = json.loads((run_dir / "placement.json").read_text())
        victim = next(e for e in ranks if e.get("rank") == 1)
        killed.append(list(scratch.glob(f"*/rank_00001.{victim['pid']}-*")))
        os.kill(victim["pid"], signal.SIGKILL)

    killer = threading.Thread(target=kill_rank_1, daemon=True)
    killer.start()
    summary = train(cfg)
    killer.join(timeout=10)
    assert killed and killed[0], "rank 1's scratch directory was there when it was killed"
    assert summary["restarts"] == 1 and summary["attempts"][1]["info"]["resumed_from_step"] == 3
    for key in ("loss", "grad_norm"):
        assert logged(cfg, key) == logged(cpu_offload, key), key
    want, got = checkpoint_tensors(cpu_offload.run_dir), checkpoint_tensors(cfg.run_dir)
    assert all(torch.equal(got[key], value) for key, value in want.items())
    assert os.listdir(scratch) == []


def test_nvme_path_checked_before_any_worker(tmp_path: Path):
    """A file for a directory, memory for a disk, and too little free space: one line each, before a worker."""
    a_file = tmp_path / "file"
    a_file.write_text("")
    cases = [(f"strategy.nvme_path={a_file}", "not a directory")]
    cases.append(("model.n_layers=2000", "GiB free"))  # 2000 of nano's blocks: AdamW state beyond any disk here
    if directio.filesystem_type("/dev/shm") == "tmpfs":
        cases.append(("strategy.nvme_path=/dev/shm", "host memory"))
    for override, words in cases:
        cfg = make_config(tmp_path, "strategy=nvme", f"strategy.nvme_path={tmp_path}", "model.dim=4096", override)
        with pytest.raises(ConfigError, match="strategy.nvme_path") as raised:
            validate(cfg)
        assert words in str(raised.value)
