"""What the driver hands each rank of collective training (`train.rank.run_rank`), and where its attempt starts.
Torch-free: the driver builds it, once, from the validated config, and fills in each attempt's layout and start;
Ray pickles it to the workers as it is."""

from __future__ import annotations

from dataclasses import dataclass, field

from distrain.config import TrainConfig
from distrain.strategy.layout import Layout


@dataclass(frozen=True)
class Fresh:
    """The attempt starts at step 0: nothing committed yet, no replica kept."""


@dataclass(frozen=True)
class FromCheckpoint:
    path: str  # the committed checkpoint (on an object store: the driver's choice there, fetched by each node)


@dataclass(frozen=True)
class FromReplicas:
    """The attempt starts from the state its ranks' live replicas kept in memory, not from a checkpoint:
    `sources[r]` is the rank whose memory holds rank r's shard at `step` (r itself, or a rank of another
    data-parallel replica that sends it). `lines`: the last logged steps' metrics (step → metrics), whose lines
    may not have been written (they are read back a step late, on every rank, and rank 0 may be the one that died)."""

    run: str  # the run whose state the ranks hold (a kept worker of another run offers none)
    step: int
    sources: tuple[int, ...]
    number: int  # this run's recoveries from replicas so far, this one included (fault.kill_mid_transfer)
    lines: dict[int, dict] = field(default_factory=dict)


Start = Fresh | FromCheckpoint | FromReplicas
FRESH = Fresh()


@dataclass(frozen=True)
class RankJob:
    config: TrainConfig  # validated, with what the workers must see resolved (launch.resolved)
    layout: Layout  # the attempt's: the size of its group decides it
    run_dir: str
    started_at: float  # when the driver started: summary.json's time to the first step counts from it
    wandb_run_id: str | None = None  # one W&B run across every attempt
    start: Start = FRESH  # where the attempt's state comes from (driver/collective.py decides)
    use_gpu: bool | None = None  # Ray gave the rank a GPU, which it must train on; None: whatever torch sees
    run_id: str = ""  # one run of the driver: what a rank's kept state is matched against
    base: str | None = None  # a LoRA run's base model (driver/finetune.base_fingerprint), which checkpoints record
