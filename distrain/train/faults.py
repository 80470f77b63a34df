"""Faults injected on purpose (fault.* in the config), for tests and benchmarks: a slow rank, a run held
at a known point while a test changes the world around it, and a rank killed at a known step."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

from distrain.channel import Channel, Phase
from distrain.config import FaultConfig

AFTER_STEP, AFTER_BACKWARD, MID_UPLOAD = "after the step", "after the backward", "mid-upload"  # where a kill lands


class Faults:
    def __init__(self, cfg: FaultConfig, rank: int, channel: Channel):
        self.cfg, self.rank, self.channel = cfg, rank, channel

    def hold(self) -> None:
        """Wait while fault.hold_file exists, unless the supervisor asks the rank to stop. While it waits, the
        file `<hold_file>.held.<rank>` says so (a rank killed meanwhile leaves it): a test changes the world once
        every rank is held, not while one is still inside a step's collectives."""
        path = self.cfg.hold_file
        if path is None or not os.path.exists(path):
            return
        self.channel.report(phase=Phase.WAIT)
        marker = f"{path}.held.{self.rank}"
        open(marker, "w").close()
        try:
            while os.path.exists(path) and self.channel.stop_deadline is None:
                time.sleep(0.02)
        finally:
            os.remove(marker)
        self.channel.report(phase=Phase.TRAIN)

    def straggle(self, compute_s: float) -> None:
        """The simulated straggler stretches its step to fault.straggler_slowdown × its compute time."""
        if self.cfg.straggler == self.rank:
            time.sleep((self.cfg.straggler_slowdown - 1) * compute_s)

    def kill(self, where: str, step: int, began: int, settle: Callable[[], object]) -> None:
        """SIGKILL this process (as the OOM killer or a lost node ends one, with no chance to clean up) at `where`
        in step fault.kill_at_step (AFTER_STEP: once done, its checkpoint if due begun; AFTER_BACKWARD, with
        fault.kill_after_backward: right after its backward) on rank fault.kill_rank, in an attempt that began at
        step 0 (`began`): the attempt that resumes from a checkpoint goes on to the end. `settle` runs first: it
        finishes the logged loss in flight on its way to the other ranks, which a kill in that very instant would
        take with it (a kill at a known step is for tests that compare every logged line)."""
        if self._where() == where and self._due(step, began):
            settle()
            os.kill(os.getpid(), signal.SIGKILL)

    def fail_in_update(self, step: int, began: int) -> None:
        """fault.fail_in_update: every rank raises once step fault.kill_at_step's update is made, before it counts."""
        if self.cfg.fail_in_update and self.cfg.kill_at_step == step and began == 0:
            raise RuntimeError(f"fault.fail_in_update: failed inside the optimizer update of step {step}")

    def kill_uploading(self, step: int, began: int) -> None:
        """fault.kill_mid_upload: `kill` made instead while step fault.kill_at_step's checkpoint is being
        uploaded to the object store, once this rank's first object is there (the others are not)."""
        if self._where() == MID_UPLOAD and self._due(step, began):
            os.kill(os.getpid(), signal.SIGKILL)

    def kill_mid_transfer(self, recovery: int) -> None:
        """fault.kill_mid_transfer: rank fault.kill_rank SIGKILLs itself halfway through the state transfer of
        the run's first recovery from replicas (its first message sent or received, the tensors not)."""
        if self.cfg.kill_mid_transfer and recovery == 1 and self.cfg.kill_rank == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)

    def _where(self) -> str:
        """Where fault.kill_at_step's kill happens."""
        if self.cfg.kill_mid_upload:
            return MID_UPLOAD
        return AFTER_BACKWARD if self.cfg.kill_after_backward else AFTER_STEP

    def _due(self, step: int, began: int) -> bool:
        return self.cfg.kill_at_step == step and self.cfg.kill_rank == self.rank and began == 0
