"""The step log of collective training: the logging windows and their lines. A logged step's figures are taken when
its window closes, its loss and gradient norm read back from the device a step later (`Readback`), so that no step
waits on the host; the lines read back last are what a rank keeps for a recovery from its replicas."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from distrain.channel import Channel
from distrain.config import TrainConfig
from distrain.model.size import flops_per_token
from distrain.storage.saver import Saver
from distrain.storage.tracking import Tracker
from distrain.train.metrics import Readback, memory_peaks, peak_flops


@dataclass
class Window:
    """A logging window: when its training began (time outside steps moves it on) and the steps it has trained."""

    began: float
    steps: int = 0


@dataclass(frozen=True)
class Unread:
    """A logged step whose figures are taken and whose loss and gradient norm are on their way to the host."""

    step: int
    metrics: dict
    readback: Readback


class StepLog:
    def __init__(
        self,
        cfg: TrainConfig,
        device: torch.device,
        precision: str,
        world: int,
        tracker: Tracker | None,
        channel: Channel,
        mean_of: Callable[[float], float],
        name_figures: Callable[[list[float]], dict[str, float]],
    ):
        """`name_figures`: a step's further figures (the experts' loads, `close`'s `more`) as its metrics."""
        self.cfg, self.device, self.tracker, self.channel, self.mean_of = cfg, device, tracker, channel, mean_of
        self.name_figures = name_figures
        t, peak = cfg.trainer, peak_flops(device, precision)  # a logged step's FLOP/s as MFU: once, here
        self.flops_to_mfu = flops_per_token(cfg.model, t.seq_len) / (peak * world) if peak else None
        self.window = Window(time.perf_counter())
        self.unread: Unread | None = None
        self.last_read: dict[int, dict] = {}  # the last logged step read back (every rank: for a recovery)
        self.blocked_s = 0.0  # how long checkpoints held the loop up since the last logged step

    def open(self) -> None:
        """The first window begins, with the memory peaks reset."""
        memory_peaks(self.device, reset=True)
        self.window = Window(time.perf_counter())

    def pause(self, seconds: float) -> None:
        """Time spent outside steps (checkpoints, evaluation): not training time."""
        self.window.began += seconds

    def close(
        self,
        step: int,
        lr: float,
        loss_sum: torch.Tensor,
        grad_norm: torch.Tensor,
        more: torch.Tensor | None,
        saver: Saver,
    ) -> None:
        """Close this logging window at `step`: its figures now, its loss, gradient norm and `more` (figures summed
        over the ranks already) on their way to the host."""
        t = self.cfg.trainer
        elapsed = time.perf_counter() - self.window.began
        tokens_per_s = t.global_batch_size * t.seq_len * self.window.steps / elapsed
        metrics = {
            "lr": lr,
            "tokens_per_s": tokens_per_s,
            "step_time_s": elapsed / self.window.steps,
            **memory_peaks(self.device, reset=True),
        }
        if self.flops_to_mfu is not None:
            metrics["mfu"] = self.flops_to_mfu * tokens_per_s
        if self.blocked_s:  # logged with the next step: the saving step's line is written before its save
            metrics["checkpoint_block_s"], self.blocked_s = self.blocked_s, 0.0
        store = saver.remote
        if store is not None and store.upload_s is not None:  # a commit on the store since the last line
            metrics["checkpoint_upload_s"], store.upload_s = store.upload_s, None
        self.unread = Unread(step, metrics, Readback(loss_sum, grad_norm, more))
        self.window = Window(time.perf_counter())

    def settle(self) -> None:
        """Wait until the logged step in flight has its loss summed over the ranks, without logging it."""
        if self.unread is not None:
            self.unread.readback.read()

    def read(self, **extra: float) -> dict | None:
        """Log the step `close` left in flight, if any, with `extra` figures (its validation loss): its line."""
        if self.unread is None:
            return None
        unread, self.unread = self.unread, None
        metrics = {**self.figures_read(unread), **extra}
        self.last_read = {unread.step: metrics}
        if self.tracker is not None:
            self.tracker.log(unread.step, metrics)
        self.channel.report(metrics=metrics, logged=unread.step)  # the progress line shows these beside their step
        return metrics

    def lines(self, committed: int) -> dict[int, dict]:
        """The last logged steps' lines, for a recovery from replicas: the one read back last, and the one still
        being read back if it is step `committed`'s and its sum has arrived (never waited for after a failure)."""
        lines = dict(self.last_read)
        unread = self.unread
        if unread is not None and unread.step == committed and unread.readback.ready():
            with contextlib.suppress(Exception):
                lines[committed] = self.figures_read(unread)
        return lines

    def figures_read(self, unread: Unread) -> dict:
        """A logged step's line: its figures read back (waiting for them) and those taken when its window closed."""
        loss_total, grad_norm, more = unread.readback.read()
        named = self.name_figures(more) if more else {}
        return {"loss": self.mean_of(loss_total), "grad_norm": grad_norm, **named, **unread.metrics}
