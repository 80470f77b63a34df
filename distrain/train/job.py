"""What the driver hands each rank of collective training (`train.loop.run_rank`). Torch-free: the driver
builds it, once, from the validated config, and fills in each attempt's layout and checkpoint; Ray pickles
it to the workers as it is."""

from __future__ import annotations

from dataclasses import dataclass

from distrain.config import TrainConfig
from distrain.strategy.layout import Layout


@dataclass(frozen=True)
class RankJob:
    config: TrainConfig  # validated, with what the workers must see resolved (launch.resolved)
    layout: Layout  # the attempt's: the size of its group decides it
    run_dir: str
    started_at: float  # when the driver started: summary.json's time to the first step counts from it
    wandb_run_id: str | None = None  # one W&B run across every attempt
    resume_from: str | None = None  # the committed checkpoint the attempt starts from
    use_gpu: bool | None = None  # Ray gave the rank a GPU, which it must train on; None: whatever torch sees
