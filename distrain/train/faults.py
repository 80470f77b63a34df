"""Faults injected on purpose (fault.* in the config), for tests and benchmarks: a slow rank, and a
run held at a known point while a test changes the world around it."""

from __future__ import annotations

import os
import time

from distrain.channel import Channel, Phase
from distrain.config import FaultConfig


class Faults:
    def __init__(self, cfg: FaultConfig, rank: int, channel: Channel):
        self.cfg, self.rank, self.channel = cfg, rank, channel

    def hold(self) -> None:
        """Wait while fault.hold_file exists, unless the supervisor asks the rank to stop."""
        path = self.cfg.hold_file
        if path is None or not os.path.exists(path):
            return
        self.channel.report({"phase": Phase.WAIT})
        while os.path.exists(path) and self.channel.stop_deadline is None:
            time.sleep(0.02)
        self.channel.report({"phase": Phase.TRAIN})

    def straggle(self, compute_s: float) -> None:
        """The simulated straggler stretches its step to fault.straggler_slowdown × its compute time."""
        if self.cfg.straggler == self.rank:
            time.sleep((self.cfg.straggler_slowdown - 1) * compute_s)
