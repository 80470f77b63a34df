"""Workers' per-step records → one metrics line per step, as every other strategy logs.

Step k is global batch k: worker w's step k is its slice of it. Shard 0 hands over a worker's
record of a step once the step's fate is known (applied, or dropped by a sync round that closed
without it), so records arrive in step order per worker, and a worker that has reported step k
(or restarted past it) has nothing more to say about earlier steps. A line is written once every
worker is past its step. The log outlives attempts: after a restore from a checkpoint it keeps what
the checkpoint holds (each worker's records up to its last applied step) and forgets the rest, which
the workers redo.
"""

from __future__ import annotations

import statistics
from collections import deque

from distrain.config import TrainConfig
from distrain.train.optim import lr_at

WINDOW = 10  # records per worker (and lines) that rates are averaged over


class StepLog:
    def __init__(self, cfg: TrainConfig):
        t = cfg.trainer
        self.cfg, self.max_steps, self.world = cfg, t.max_steps, cfg.cluster.num_workers
        self.eval_interval = t.eval_interval
        self.tokens_per_step = t.global_batch_size * t.seq_len
        # Kept from the newest committed checkpoint on: a restore from it needs those its weights hold.
        self.records: dict[int, dict[int, dict]] = {}  # step → worker → its record
        self.val: dict[int, float] = {}  # step → worker 0's validation loss of the weights after it
        self.reached = [0] * self.world  # each worker's highest reported step
        self.written = 0  # the newest step whose line is written
        self.line_times: deque[float] = deque(maxlen=WINDOW + 1)  # when each recent line's step ended
        self.versions: deque[tuple[float, int]] = deque(maxlen=WINDOW + 1)  # (driver time, server version)
        self.worker_times = [deque(maxlen=WINDOW + 1) for _ in range(self.world)]  # (step, time)
        self.first_record_time: float | None = None

    def restart(self, step: int, applied: dict[int, int], kept: list[dict]) -> None:
        """A new attempt from a checkpoint at `step` whose weights hold each worker's steps up to
        `applied[w]`: lines after `step` are written again; records of steps a worker will redo go;
        `kept` (the checkpoint's records of steps past `step` that no worker redoes) come back."""
        self.written = step
        self.reached = [applied.get(w, step) for w in range(self.world)]
        self.records = {}
        self.val = {}
        self.add([r for r in kept if r["step"] <= applied.get(r["worker"], step)], version=None, now=None)

    def add(self, records: list[dict], version: int | None, now: float | None) -> None:
        for r in records:
            w = r["worker"]
            if "start" in r:  # a worker (re)starting at step `start` reports nothing before it
                self.reached[w] = max(self.reached[w], min(r["start"] - 1, self.max_steps))
            elif "val_loss" in r:
                self.val[r["step"]] = r["val_loss"]
            elif r["step"] > self.written and w not in self.records.get(r["step"], {}):  # the first push counts
                self.records.setdefault(r["step"], {})[w] = r
                self.reached[w] = max(self.reached[w], r["step"])
                self.first_record_time = self.first_record_time or r["time"]
        if version is not None:
            self.versions.append((now, version))

    def unwritten(self, step: int, applied: dict[int, int]) -> list[dict]:
        """What a checkpoint at `step` whose weights hold each worker's steps up to `applied[w]` must keep
        to write the lines after it again: those workers' records of the steps they will not redo."""
        records = [r for k, got in self.records.items() if k > step for w, r in got.items() if k <= applied[w]]
        return records + [{"worker": 0, "step": k, "val_loss": v} for k, v in self.val.items() if k > step]

    def committed(self, step: int) -> None:
        """A checkpoint at `step` is committed: nothing before it is needed again."""
        self.records = {k: got for k, got in self.records.items() if k > step}
        self.val = {k: v for k, v in self.val.items() if k > step}

    def lines(self, finished: bool = False) -> list[tuple[int, dict]]:
        """The lines now complete, in step order: every worker is past them (and for a validation step,
        worker 0 has evaluated it), or training ended (`finished`: whatever was reported)."""
        out = []
        # The last step waits for the end: its line gets the final evaluation.
        last = max([self.written, *self.records]) if finished else min([*self.reached, self.max_steps - 1])
        while self.written < last:
            k = self.written + 1
            if not finished and self._awaits_validation(k):
                break
            self.written = k
            if self.records.get(k):
                out.append((k, self.line(k, list(self.records[k].values()))))
        return out

    def _awaits_validation(self, step: int) -> bool:
        evaluated = self.eval_interval and step % self.eval_interval == 0 and step < self.max_steps
        return bool(evaluated) and step not in self.val and self.reached[0] <= step

    def step_time_s(self) -> float | None:
        """The recent mean time per step."""
        times = self.line_times
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None

    def line(self, step: int, records: list[dict]) -> dict:
        ended = max([r["time"] for r in records] + list(self.line_times)[-1:])  # monotonic
        self.line_times.append(ended)
        for r in records:
            self.worker_times[r["worker"]].append((r["step"], r["time"]))
        norms = [r["round_norm"] for r in records if "round_norm" in r]  # sync: the averaged gradient's
        line = {
            "time": ended,  # when the step ended, not when the driver wrote it
            "loss": statistics.fmean(r["loss"] for r in records),
            "lr": lr_at(step, self.cfg.optim, self.max_steps),
            "grad_norm": norms[0] if norms else statistics.fmean(r["grad_norm"] for r in records),
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
        if len(self.versions) > 1:
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
        if step in self.val:
            line["val_loss"] = self.val[step]
        return line
