"""Console progress lines: training's (step, loss, throughput and time left, from rank 0's reports) and a
job's through a known amount of work (bytes of a corpus)."""

from __future__ import annotations

import sys
import time

from distrain.channel import Progress


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class _Line:
    """Redraws one line on a terminal; elsewhere (job logs, CI) prints a line every `interval_s`."""

    def __init__(self, interval_s: float, stream=None):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.interval_s = 0.0 if self.tty else interval_s
        self.start = time.time()

    def _write(self, line: str) -> None:
        self.stream.write(f"\r\033[K{line}" if self.tty else line + "\n")
        self.stream.flush()


class WorkLine(_Line):
    """Progress through `total` units of work (bytes read, say): done, share, rate and time left."""

    def __init__(self, label: str, total: int, interval_s: float = 10.0, stream=None):
        super().__init__(interval_s, stream)
        self.label, self.total, self.last_print = label, max(total, 1), self.start

    def update(self, done: int, detail: str = "", final: bool = False) -> None:
        now = time.time()
        if not final and now - self.last_print < max(self.interval_s, 0.1):
            return
        self.last_print = now
        rate = done / max(now - self.start, 1e-9)
        parts = [f"{self.label} {done / 1e6:.1f}/{self.total / 1e6:.1f} MB ({100 * done / self.total:.0f}%)"]
        parts += [detail] if detail else []
        parts.append(f"{rate / 1e6:.1f} MB/s")
        if not final and rate > 0:
            parts.append(f"ETA {_duration((self.total - done) / rate)}")
        parts.append(f"elapsed {_duration(now - self.start)}")
        self._write(" | ".join(parts))
        if final and self.tty:
            self.stream.write("\n")
            self.stream.flush()


SHOWN = ("loss", "val_loss", "tokens_per_s")  # the figures of a step's line the progress line shows (and experts')


class ProgressLine(_Line):
    """Training's line, from rank 0's progress reports: the newest step whose line the run has logged, with
    that line's figures. A collective rank reads a step's loss back during the next step, and says which step
    its figures are of (`logged`: from the step it starts at, with none); a parameter server's report is of its
    `step`. A new attempt's reports carry no figures until its first logged step: the line never shows a loss
    beside a step it is not of (the newest validation loss stands beside the steps after its own)."""

    def __init__(self, interval_s: float, stream=None):
        super().__init__(interval_s, stream)
        self.first: tuple[float, int] | None = None  # (time, step) at the first report, for the rate
        self.last_print = 0.0
        self.shown: tuple | None = None  # the step and figures last rendered
        self.metrics: dict = {}
        self.unprinted: str | None = None  # the newest line, held back by the interval
        self.said: set[str] = set()

    def update(self, progress: Progress) -> None:
        for line in progress.said:  # rank 0's own lines (a checkpoint not committed), each once
            if line not in self.said:
                self.said.add(line)
                self.message(line)
        step = progress.step if progress.logged is None else progress.logged
        metrics = {k: v for k, v in progress.metrics.items() if k in SHOWN or k.startswith("moe_imbalance_")}
        if step is None or (step, metrics) == self.shown:
            return
        now = time.time()
        if self.first is None:
            self.first = (now, step)
        self.shown, self.metrics = (step, metrics), metrics
        self.unprinted = self.render(step, progress.max_steps, now)
        if now - self.last_print >= self.interval_s:
            self.last_print = now
            self._write(self.unprinted)
            self.unprinted = None

    def message(self, text: str) -> None:
        """An event (a failure, a recovery) on a line of its own; a terminal's progress line is
        redrawn below it at the next update."""
        self.stream.write(("\r\033[K" if self.tty else "") + f"distrain: {text}\n")
        self.stream.flush()

    def render(self, step: int, max_steps: int, now: float) -> str:
        parts = [f"step {step}/{max_steps}"]
        m = self.metrics
        if "loss" in m:
            parts.append(f"loss {m['loss']:.4f}")
        if "val_loss" in m:
            parts.append(f"val {m['val_loss']:.4f}")
        if "tokens_per_s" in m:
            parts.append(f"{m['tokens_per_s'] / 1e3:.1f}k tok/s")
        imbalance = [v for k, v in m.items() if k.startswith("moe_imbalance_")]
        if imbalance:  # the busiest expert of any layer, against its layer's mean
            parts.append(f"experts ≤ {max(imbalance):.2f}× mean")
        t0, s0 = self.first
        if step > s0:
            parts.append(f"ETA {_duration((now - t0) / (step - s0) * (max_steps - step))}")
        parts.append(f"elapsed {_duration(now - self.start)}")
        return " | ".join(parts)

    def close(self) -> None:
        """Print the newest state if the interval held it back; end the terminal's line."""
        if self.unprinted is not None:
            self._write(self.unprinted)
        if self.tty and self.shown is not None:
            self.stream.write("\n")
            self.stream.flush()
