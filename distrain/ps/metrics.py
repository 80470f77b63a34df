"""Workers' per-step records → one metrics line per step, as every other strategy logs.

Step k is global batch k: worker w's step k is its slice of it. Workers reach step k at
different times (async modes drift apart), so the line for step k is written once every worker
has reported step k or a later one; a record lost with a dead worker leaves its step's line
averaged over the others.
"""

from __future__ import annotations

import statistics
from collections import deque

from distrain.config import TrainConfig
from distrain.train.optim import lr_at

WINDOW = 10  # records per worker (and lines) that rates are averaged over


class StepLog:
    def __init__(self, cfg: TrainConfig, resume_step: int):
        t = cfg.trainer
        self.cfg, self.max_steps, self.world = cfg, t.max_steps, cfg.cluster.num_workers
        self.tokens_per_step = t.global_batch_size * t.seq_len
        self.records: dict[int, dict[int, dict]] = {}  # step → worker → its record
        self.reached = [resume_step] * self.world  # each worker's highest reported step
        self.written = resume_step
        self.line_times: deque[float] = deque(maxlen=WINDOW + 1)  # when each recent line's step ended
        self.versions: deque[tuple[float, int]] = deque(maxlen=WINDOW + 1)  # (driver time, server version)
        self.worker_times = [deque(maxlen=WINDOW + 1) for _ in range(self.world)]  # (step, time)
        self.first_record_time: float | None = None

    def add(self, records: list[dict], version: int, now: float) -> None:
        for r in records:
            if "start" in r:  # a worker (re)starting at step `start` reports nothing before it
                self.reached[r["worker"]] = max(self.reached[r["worker"]], min(r["start"] - 1, self.max_steps))
                continue
            w, k = r["worker"], r["step"]
            if k <= self.written or w in self.records.get(k, {}):
                continue  # a step logged already, or pushed twice (by a replacement)
            self.records.setdefault(k, {})[w] = r
            self.reached[w] = max(self.reached[w], k)
            self.first_record_time = self.first_record_time or r["time"]
        self.versions.append((now, version))

    def lines(self, finished: bool = False, upto: int | None = None) -> list[tuple[int, dict]]:
        """The lines now complete, in step order: every worker is past them, or training ended
        (`finished`), or no more records will come up to `upto` (the servers were lost)."""
        out = []
        # The last step waits for the end: its line gets the final evaluation.
        last = max([self.written, *self.records]) if finished else min([*self.reached, self.max_steps - 1])
        last = max(last, upto or 0)
        while self.written < last:
            k = self.written + 1
            self.written = k
            got = self.records.pop(k, {})
            if got:
                out.append((k, self.line(k, list(got.values()))))
        return out

    def step_time_s(self) -> float | None:
        """The recent mean time per step, for the hang limit."""
        times = self.line_times
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None

    def line(self, step: int, records: list[dict]) -> dict:
        ended = max([r["time"] for r in records] + list(self.line_times)[-1:])  # monotonic
        self.line_times.append(ended)
        for r in records:
            self.worker_times[r["worker"]].append((r["step"], r["time"]))
        line = {
            "time": ended,  # when the step ended, not when the driver wrote it
            "loss": statistics.fmean(r["loss"] for r in records),
            "lr": lr_at(step, self.cfg.optim, self.max_steps),
            "grad_norm": statistics.fmean(r["grad_norm"] for r in records),
            "bytes_pushed": sum(r["bytes_pushed"] for r in records),
            "bytes_pulled": sum(r["bytes_pulled"] for r in records),
            "peak_memory_bytes": max(r["peak_memory_bytes"] for r in records),
            "workers": len(records),
        }
        if len(self.line_times) > 1:
            span = self.line_times[-1] - self.line_times[0]
            steps = len(self.line_times) - 1
            line["step_time_s"] = span / steps
            line["tokens_per_s"] = self.tokens_per_step * steps / span if span > 0 else 0.0
        (t0, v0), (t1, v1) = self.versions[0], self.versions[-1]
        if t1 > t0:
            line["updates_per_s"] = (v1 - v0) / (t1 - t0)
        line["worker_steps_per_s"] = {
            str(w): (times[-1][0] - times[0][0]) / (times[-1][1] - times[0][1])
            for w, times in enumerate(self.worker_times)
            if len(times) > 1 and times[-1][1] > times[0][1]
        }
        stale = [r["staleness"] for r in records if r.get("staleness") is not None]
        if stale:
            line["staleness_mean"], line["staleness_max"] = statistics.fmean(stale), max(stale)
        if any("applied" in r for r in records):
            line["dropped"] = sum(not r.get("applied", True) for r in records)
        val = [r["val_loss"] for r in records if "val_loss" in r]
        if val:
            line["val_loss"] = val[0]
        return line
