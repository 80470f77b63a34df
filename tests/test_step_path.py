"""The step path's parts that keep a step from waiting: inputs prepared a step ahead, scalars read back a
step late, checkpoints staged then written in the background, memory peaks per logging window."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from distrain.data.loader import Batches, Prefetch
from distrain.storage import checkpoint, saver
from distrain.train.metrics import Readback, memory_peaks
from distrain.train.optim import kernels
from distrain.train.stopvote import StopVote

pytestmark = [pytest.mark.usefixtures("process_group"), pytest.mark.timeout(60)]


def test_prefetched_batches_are_the_loaders_in_order_and_out_of_order():
    batches = Batches(np.arange(5000, dtype=np.uint8), seq_len=16, batch_size=8, seed=3)
    prefetch = Prefetch(batches, (1, 2), torch.device("cpu"))
    for step in [1, 2, 3, 7, 8, 2]:  # a jump and a step back: prepared then, not taken from the one ahead
        got, want = prefetch.get(step), batches.get(step, 1, 2)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), step


def test_readback_gives_the_reduced_loss_and_the_norm():
    loss, norm, _ = Readback(torch.tensor(2.5), torch.tensor(0.75)).read()
    assert (loss, norm) == (2.5, 0.75)  # one rank: its own sum


def test_a_background_checkpoint_holds_the_state_at_save_time(tmp_path):
    """The step goes on while the write happens: a write that read the live tensors would catch the
    next optimizer step's values."""
    model = nn.Linear(64, 64)
    with torch.no_grad():
        model.weight.fill_(1.0)
    writer = saver.Saver(tmp_path, keep=2, background=True)
    writer.save(1, {"model": model.state_dict()}, {"step": 1, "world_size": 1}, {})
    assert writer.pending is not None  # returned before the commit: the write is the thread's
    with torch.no_grad():
        model.weight.fill_(2.0)  # the next step
    writer.close()
    path = checkpoint.latest(tmp_path)
    assert path is not None and path.name == "step_00000001"
    state = {"model": nn.Linear(64, 64).state_dict()}
    dcp.load(state, checkpoint_id=str(path))
    assert torch.equal(state["model"]["weight"], torch.ones(64, 64))


@pytest.mark.parametrize("pin", [False, True], ids=["plain", "pinned"])
def test_one_saver_commits_every_background_save_of_a_run(tmp_path, monkeypatch, pin: bool):
    """A run's Saver makes every background save through one stager. torch 2.11's stager emptied itself
    after each stage, so from the second save on staging raised `KeyError: <class 'type'>` (issue 30).
    `pin` is the GPU's setting (host copies pinned, copied without blocking); without an accelerator
    torch pins nothing, and the same saves must still commit. The disk is made slow: each `save` returns
    while its write is still going, and the next one, staging into the same host copies, must wait for it
    (else a checkpoint would hold the next step's values)."""
    written, write = [], FileSystemWriter.write_data

    def slow_write(self, plan, planner):
        time.sleep(0.3)
        done = write(self, plan, planner)
        written.append(self.path)
        return done

    monkeypatch.setattr(FileSystemWriter, "write_data", slow_write)
    model = nn.Linear(16, 16)
    writer = saver.Saver(tmp_path, keep=4, background=True, pin=pin)
    for step in (1, 2, 3):
        with torch.no_grad():
            model.weight.fill_(step)
        # tensors and plain data, nested as an optimizer's flattened state is
        optim = {"state.weight.step": torch.tensor(float(step)), "lr": 0.1, "betas": [0.9, 0.95], "name": "adamw"}
        writer.save(step, {"model": model.state_dict(), "optim": optim}, {"step": step, "world_size": 1}, {})
        # returned before its own write finished, and after the one before it
        assert len(written) == step - 1, f"save {step} returned with {len(written)} writes finished"
    writer.close()
    assert len(written) == 3
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step_00000003", "step_00000002", "step_00000001"]
    for step in (1, 2, 3):
        path = checkpoint.step_dir(tmp_path, step)
        assert checkpoint.problem(path) is None, path
        state = {"model": nn.Linear(16, 16).state_dict(), "optim": {"state.weight.step": torch.tensor(0.0)}}
        dcp.load(state, checkpoint_id=str(path))
        assert torch.equal(state["model"]["weight"], torch.full((16, 16), float(step)))  # its own step's copy
        assert state["optim"]["state.weight.step"].item() == step


@pytest.mark.filterwarnings("ignore:Ignoring pin_memory")
def test_a_saver_on_a_gpu_asks_for_pinned_host_copies(tmp_path, monkeypatch):
    """What the trainer's `pin=device.type == "cuda"` turns into where there is an accelerator: pinned
    host copies, filled without blocking (torch itself pins only when CUDA is there)."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    for pin in (True, False):
        writer = saver.Saver(tmp_path, keep=1, background=True, pin=pin)
        options = writer.stager._config
        assert (options.use_pinned_memory, options.use_non_blocking_copy) == (pin, pin)
        writer.close()


def test_memory_peaks_start_again_after_a_reset():
    memory_peaks(torch.device("cpu"), reset=True)
    big = torch.ones(64 << 20)  # 256 MiB, touched, then freed
    del big
    high = memory_peaks(torch.device("cpu"), reset=True)["peak_memory_bytes"]
    low = memory_peaks(torch.device("cpu"))["peak_memory_bytes"]
    assert high - low > 200 << 20


def test_the_optimizer_takes_foreach_kernels_off_the_gpu():
    assert kernels([torch.zeros(2)]) == {"foreach": True}


def test_the_stop_vote_judges_a_save_against_the_deadline_to_the_second():
    """A vote is counted a step after it is cast (the last step's at once), and a save fits only if the last one's
    duration ends before the deadline: one second over is over, though both are wall-clock times near 1.8e9."""
    vote, deadline = StopVote(), time.time() + 60
    assert vote.count(deadline, 1.0, last=False) == (False, False)  # cast, counted at the next step
    assert vote.count(deadline, 61.0, last=False) == (True, True)  # the first vote: 1 s of saving fits
    assert vote.count(deadline, 61.0, last=True) == (True, False)  # 61 s of saving ends past the deadline
    assert vote.count(None, 1.0, last=True) == (False, False)  # no stop asked
