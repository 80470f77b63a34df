"""A rank's training state, its one home: the model and optimizer (the learner's), the random number generators,
the step (the data position: batches are a pure function of the step) and the last loss. It is captured, saved,
kept in memory for the next attempt's replicas, and restored from where the driver's `Start` says: a checkpoint
or the live replicas, two sources behind one interface (a third, a checkpoint streamed from the object store,
would be one more class). The driver's half of a start: driver/collective.py; the replicas' transfer:
train/replicas.py."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from distrain.config import ClusterConfig
from distrain.parallel.float8 import unwrapped
from distrain.storage import checkpoint, remote, saver
from distrain.storage.safeload import DamagedCheckpointError
from distrain.strategy.layout import Layout
from distrain.train import replicas
from distrain.train.job import FromCheckpoint, FromReplicas, Start
from distrain.train.learner import Learner
from distrain.train.nvme import NVMeAdamW
from distrain.train.optim import Optimizers, local_optimizers

STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def rng_states(device: torch.device) -> dict:
    """This process's random number generators' states: a checkpoint's per-rank state, a replica's."""
    states = {"cpu_rng": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda_rng"] = torch.cuda.get_rng_state(device)
    return states


def seed_rngs(seed: int, stage: int) -> None:
    """Seed this process's generators for a fresh start from the run's seed and the rank's pipeline stage: a run
    draws the same numbers whatever ran in its worker before (warm workers are reused), and every rank of a stage
    draws alike (as torchtitan and Megatron-LM seed data parallelism), so the generators a replacement
    takes from a replica are the ones the rank it replaces had."""
    torch.manual_seed(seed + stage * 2**32)


def set_rng_states(states: dict, device: torch.device) -> None:
    torch.set_rng_state(states["cpu_rng"])
    if "cuda_rng" in states and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda_rng"], device)


def checkpoint_state(learner: Learner, optimizer: torch.optim.Optimizer | Optimizers) -> tuple[dict, dict]:
    """What a checkpoint holds, and the hyperparameters it leaves out. Keyed by full-model parameter
    name, whatever the layout: a checkpoint resumes on any. Optimizer state is flattened to one
    entry per parameter so that ranks holding different parameters (pipeline stages, ZeRO-1
    shards) contribute disjoint keys. Its `param_groups.*` entries (lr, betas, eps, weight decay:
    one small item per parameter and key, most of what a load reads) are not saved: the config
    says them, and the schedule sets lr every step. A LoRA run's frozen base is left out too: its model.init_from
    (or its seed) gives it again, and the checkpoint records its fingerprint (driver/finetune.py)."""
    model_sd, optim_sd = get_state_dict(learner.module, local_optimizers(optimizer), options=STATE_OPTIONS)
    model_sd = {k: v for k, v in model_sd.items() if k not in learner.frozen}  # a LoRA run's base: never saved
    groups = {k: optim_sd.pop(k) for k in [k for k in optim_sd if k.startswith("param_groups.")]}
    model_sd = {k: unwrapped(v) for k, v in model_sd.items()}  # float8-gathered weights as their plain pieces
    return {"model": model_sd, "optim": learner.parallel.checkpoint_names(optim_sd, saving=True)}, groups


@contextlib.contextmanager
def empty_groups_aside(optimizers: list[torch.optim.Optimizer]) -> Iterator[None]:
    """DCP's set_state_dict reads a group's hyperparameters under its first parameter's name, and fails on a group
    without one: ZeRO-1's share of a group of fewer parameters than ranks (optim=muon's AdamW matrices: the
    embeddings and the head; AdamW's undecayed gains of a small model). Such groups are set aside for the load
    and put back where they were."""
    empty = [[(i, g) for i, g in enumerate(o.param_groups) if not g["params"]] for o in optimizers]
    for o, aside in zip(optimizers, empty, strict=True):
        if aside:
            o.param_groups = [g for g in o.param_groups if g["params"]]
    try:
        yield
    finally:
        for o, aside in zip(optimizers, empty, strict=True):
            for i, g in aside:
                o.param_groups.insert(i, g)


class RankState:
    def __init__(
        self,
        learner: Learner,
        optimizer: torch.optim.Optimizer | Optimizers,
        device: torch.device,
        layout: Layout,
        rank: int,
    ):
        self.learner, self.optimizer, self.device, self.layout, self.rank = learner, optimizer, device, layout, rank
        self.step, self.loss = 0, math.nan
        self.whole = True  # False inside an optimizer update: a failure there leaves no state to keep
        self.committed = 0  # the last step whose optimizer update finished
        self.rng: dict = {}  # the generators as they were when step `committed` ended

    def capture(self) -> tuple[dict, dict]:
        return checkpoint_state(self.learner, self.optimizer)

    def apply(self, state: dict, groups: dict) -> None:
        """Set the model and optimizer from `state` (as `capture` made it, then filled) and the hyperparameters."""
        optimizers = local_optimizers(self.optimizer)
        with empty_groups_aside(optimizers):
            set_state_dict(
                self.learner.module,
                optimizers,
                model_state_dict=state["model"],
                optim_state_dict={**self.learner.parallel.checkpoint_names(state["optim"], saving=False), **groups},
                options=dataclasses.replace(STATE_OPTIONS, strict=not self.learner.frozen),  # LoRA: adapters
            )

    def restore(self, source: Source | None) -> None:
        """Fill the state from `source` (None: a fresh start, as built); it is whole and committed at its step."""
        if source is not None:
            source.fill(self)
        self.committed, self.rng = self.step, rng_states(self.device)

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """Around the optimizer update of `step`: a failure inside leaves a torn state, which is never kept; one
        after commits the step."""
        self.whole = False  # inside the update
        yield
        self.whole, self.committed, self.rng = True, self.step, rng_states(self.device)

    def save(self, into: saver.Saver, seed: int, recorded: dict) -> None:
        """Save the state at its step with what a resume reads of it (step, loss, layout, data position) and what the
        run records beside it (`recorded`: the config a resume is checked against, the W&B run)."""
        meta = {
            "step": self.step,
            "loss": self.loss,
            "world_size": self.layout.world_size,
            "layout": self.layout.as_dict(),
            "data": {"seed": seed, "next_step": self.step + 1},
            **recorded,
        }
        into.save(self.step, self.capture()[0], meta, rng_states(self.device))

    def keepable(self, c: ClusterConfig) -> bool:
        """Whether a replica could start from this state if the attempt failed now: whole (the failure came between
        optimizer updates), asked for, with a replica to share it, trained (a fresh start loses no step), and in
        memory (NVMe offload's is in scratch files this process no longer owns once it fails)."""
        trained = any(o.state for o in local_optimizers(self.optimizer))
        if not (self.whole and c.peer_recovery and self.layout.dp_replicate >= 2 and trained):
            return False
        return not isinstance(self.optimizer, NVMeAdamW)

    def kept(self, run: str, world: int, lines: dict[int, dict]) -> replicas.KeptState:
        """The state as the next attempt's replicas take it from this process, with the logged `lines` it read back."""
        flat = replicas.flatten(self.capture()[0])
        return replicas.KeptState(
            run,
            self.rank,
            world,
            self.committed,
            {key: replicas.local(t) for key, t in flat.items()},
            {"rng": self.rng, "loss": self.loss},
            lines,
        )


class Source(Protocol):
    """Where an attempt's state comes from: `fill` sets the state's model, optimizer, step, loss and generators."""

    def fill(self, state: RankState) -> None: ...


class CheckpointSource:
    """A committed checkpoint on shared storage, or on an object store (fetched into this node's mirror)."""

    def __init__(self, start: FromCheckpoint, store: remote.Remote | None, run_dir: Path):
        self.path, self.store, self.run_dir = start.path, store, run_dir

    def fill(self, state: RankState) -> None:
        path = self.path
        if self.store is not None:  # the driver chose it on the store: this node's mirror gets it (or an older one)
            store = self.store.store
            path = remote.fetch(store, self.run_dir / remote.PREFIX, checkpoint.step_of(Path(path).name))
            if path is None:
                raise DamagedCheckpointError(f"{store.url}/{remote.PREFIX} no longer holds a committed checkpoint")
        captured, groups = state.capture()
        meta, rank_state = checkpoint.load(path, captured)
        state.apply(captured, groups)
        state.step, state.loss = meta["step"], meta["loss"]
        if rank_state is not None:
            set_rng_states(rank_state, state.device)


class ReplicaSource:
    """The live replicas' memory of the failed attempt: this rank's own, or another replica's sent to it; every
    shard's replicas are then checked to hold the same bits. `midway`: a fault injected once a message has moved."""

    def __init__(self, start: FromReplicas, midway: Callable[[], None]):
        self.start, self.midway = start, midway

    def fill(self, state: RankState) -> None:
        start, rank = self.start, state.rank
        captured, groups = state.capture()
        own = replicas.kept_at(start.run, start.step)
        extras = replicas.fill(replicas.flatten(captured), start.sources, rank, own, self.midway)
        state.apply(captured, groups)
        state.step, state.loss = start.step, extras["loss"]
        set_rng_states(extras["rng"], state.device)
        replicas.check_replicas(replicas.flatten(state.capture()[0]), state.layout.shard_of(rank), start.step)


def source_of(start: Start, store: remote.Remote | None, run_dir: Path, midway: Callable[[int], None]) -> Source | None:
    """The source a `Start` names (None: fresh). `midway(number)`: the replicas' fault, given the recovery's number."""
    if isinstance(start, FromReplicas):
        return ReplicaSource(start, lambda: midway(start.number))
    if isinstance(start, FromCheckpoint):
        return CheckpointSource(start, store, run_dir)
    return None
