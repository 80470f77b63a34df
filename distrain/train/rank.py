"""One rank of collective training, what a worker executes (`run_rank`): process group → Trainer (train/loop.py)
→ the run's results; on a failure, the rank's state kept for a recovery from replicas, then the failure goes on.

It knows torch.distributed (through `distrain.parallel`) and nothing about Ray: it joins the process group from
torchrun-style environment variables, reports progress through the channel it is given, and reads a stop request
from it.
"""

from __future__ import annotations

import gc
import time
import traceback

import torch

from distrain.channel import Channel, Phase
from distrain.config import TrainConfig
from distrain.data.loader import run_batches
from distrain.parallel import process_group
from distrain.storage import checkpoint
from distrain.train import replicas
from distrain.train.job import FromReplicas, RankJob
from distrain.train.loop import Trainer, outside_steps_timeout_s


def run_rank(job: RankJob, channel: Channel) -> dict:
    """Train this rank's part of the run `job` describes; rank 0 returns the run's results, the others an
    empty dict. The results say `stopped` when a stop request ended the run before max_steps.

    The trainer is gone before the groups it used are let go (`process_group.release`): a DDP reducer
    left as the last holder of its group would hang the rank as it let go (docs/architecture.md, pitfalls)."""
    channel.report({"phase": Phase.JOIN})
    if not isinstance(job.start, FromReplicas):
        replicas.keep(None)  # what an earlier attempt kept here is not needed: let its memory go
    device = process_group.init_from_env(outside_steps_timeout_s(job.config.cluster), job.use_gpu)
    channel.report({"phase": Phase.SETUP, "joined_at": time.time()})
    try:
        results = run_trainer(job, device, channel)
    except BaseException as failure:
        returning(channel, "leaving its process group")
        process_group.abort()  # a graceful destroy would wait for collectives its peers may never join
        time.sleep(job.config.fault.slow_return_s)
        traceback.clear_frames(failure.__traceback__)  # the failed frames' hold on the trainer
        raise
    else:
        process_group.destroy()
    finally:
        gc.collect()  # the trainer, while the ended groups are still held
        process_group.release()
    return results


def run_trainer(job: RankJob, device: torch.device, channel: Channel) -> dict:
    """Build the trainer and run it; if it fails, keep what a live replica recovers from (nothing unless
    whole) before the failure goes on."""
    trainer = None
    try:
        trainer = Trainer(job, device, channel)
        return trainer.fit()
    except BaseException:
        if trainer is not None:
            returning(channel, "keeping its state for a recovery from replicas")
            try:
                replicas.keep(trainer.kept())
            except Exception as e:  # never in the way of the failure itself: the next attempt loads the checkpoint
                replicas.keep(None)
                checkpoint.say(f"rank {trainer.rank} keeps no state for a recovery from replicas: {e}")
        raise


def returning(channel: Channel, doing: str) -> None:
    """Tell the supervisor this rank has seen its attempt fail and is on its way back, doing what: it waits
    for such a rank however slow (a survivor it ended would take its state with it)."""
    channel.report({"returning": doing})


def warm_up(cfg: TrainConfig) -> None:
    """What a hot spare does while it waits for a rank: this module's imports (torch and the whole
    trainer, loaded as this function arrives), what torch imports on first use (DDP imports dynamo
    as it is built: 1.3 s), and the run's corpus, so that taking over costs none of them."""
    import torch._dynamo  # noqa: F401

    run_batches(cfg)
