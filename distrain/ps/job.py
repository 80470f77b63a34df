"""What the driver hands the parameter server's actors, the sibling of train/job.py's RankJob: each server of
an attempt a `ServerJob`, each worker a `WorkerJob`. Torch-free: the engine builds them from the validated
config and Ray pickles them to the actors as they are, so no actor rebuilds a config from a plain dict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distrain.config import TrainConfig
from distrain.strategy.layout import Layout


@dataclass(frozen=True)
class ServerJob:
    config: TrainConfig  # validated, with what the actors must see resolved (launch.resolved)
    resume_from: str | None = None  # the committed checkpoint the servers restore their shards from


@dataclass(frozen=True)
class WorkerJob:
    config: TrainConfig
    layout: Layout  # the run's: a worker trains on its data-parallel slice of it
    servers: tuple[Any, ...]  # the attempt's server actors (Ray handles), shard k on servers[k]
    use_gpu: bool | None = None  # Ray gave the worker a GPU, which it must train on; None: whatever torch sees
