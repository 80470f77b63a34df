"""Training efficiency under failures, for bench_recovery.py --efficiency S: 4 workers train for S seconds
with no failure, then with a random rank SIGKILLed every EVERY_S seconds, recovering from the replicas and
from the checkpoint; efficiency = useful steps ÷ wall time, relative to the run without failures."""

from __future__ import annotations

import _thread
import contextlib
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import harness
from recovery_job import logged, overrides, redone

from distrain.testing import processes

WORKERS, EVERY_S, CHECKPOINT_EVERY = 4, 30.0, 20
SYSTEMS = {"none": "no failure", "replicas": "distrain, from replicas", "checkpoint": "distrain, from checkpoint"}
TORCHFT = "torchft reports 82% at one failure a minute on GPUs"


@dataclass
class Window:
    system: str
    seconds: float
    useful: int = 0  # the highest step logged within the window
    kills: list[dict] = field(default_factory=list)  # at (s into the window), rank, redone
    steps_run: int | None = None  # steps begun over all attempts (summary.json), the redone ones included
    error: str | None = None


class Schedule(threading.Thread):
    """From the run's first logged step: a random rank killed every `every` s, the first after half of that
    (when `kill`: window ÷ every kills), and at the window's end the driver interrupted (as on Ctrl-C)."""

    def __init__(self, run_dir: Path, seconds: float, every: float, kill: bool):
        super().__init__(daemon=True)
        self.run_dir, self.seconds, self.every, self.kill = run_dir, seconds, every, kill
        self.start_at: float | None = None
        self.kills: list[dict] = []
        self.stopped, self.done, self.rng = threading.Event(), threading.Event(), random.Random(str(run_dir))

    def pids(self) -> dict[int, int]:
        placement = harness.read_json(self.run_dir / "placement.json", [])
        return {e["rank"]: e["pid"] for e in placement if "rank" in e}

    def run(self) -> None:
        while not self.done.is_set() and not (lines := logged(self.run_dir)):
            time.sleep(0.05)
        if self.done.is_set():
            return
        self.start_at = lines[0]["time"]
        at = self.every / 2
        while self.kill and at < self.seconds and not self.done.wait(max(0.0, self.start_at + at - time.time())):
            self.kill_one()
            at += self.every
        if not self.done.wait(max(0.0, self.start_at + self.seconds - time.time())):
            self.stopped.set()
            _thread.interrupt_main()

    def kill_one(self) -> None:
        """SIGKILL a random rank of the attempt now; placement.json may still name a rank that just died
        (a recovery under way): then look again, for at most 5 s."""
        deadline = time.time() + 5
        while time.time() < deadline and not self.done.is_set():
            if pids := self.pids():
                rank = self.rng.randrange(len(pids))
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pids[rank], signal.SIGKILL)
                    self.kills.append({"at": round(time.time() - self.start_at, 2), "rank": rank, "pid": pids[rank]})
                    print(f"recovery_efficiency: kill at {self.kills[-1]['at']:.1f} s: rank {rank}", flush=True)
                    return
            time.sleep(0.1)


def run_window(system: str, args, storage: Path, repeat: int) -> Window:
    from distrain.driver.cli import compose
    from distrain.driver.launch import train

    name, kills = f"efficiency-{system}-{repeat}", int(args.efficiency // EVERY_S) + 3
    interval = CHECKPOINT_EVERY if system == "checkpoint" else 0
    mode = "checkpoint" if system == "checkpoint" else "replicas"
    cfg = compose(overrides(args, mode, WORKERS, storage, name, steps=10**6, interval=interval, kills=kills))
    run_dir, window = Path(cfg.run_dir), Window(system, args.efficiency)
    every = args.efficiency / 3 if args.smoke else EVERY_S  # the smoke's window is short: two kills in it
    schedule = Schedule(run_dir, args.efficiency, every, kill=system != "none")

    def call() -> None:
        try:
            train(cfg)
        except KeyboardInterrupt:
            if not schedule.stopped.is_set():
                raise

    schedule.start()
    try:
        _, window.error = processes.interrupt_after(args.efficiency + 300, call)
    finally:
        schedule.done.set()
        schedule.join(timeout=10)
    if schedule.start_at is None:
        return Window(system, args.efficiency, error=window.error or "no step was logged")
    end = schedule.start_at + args.efficiency
    window.useful = max((r["step"] for r in logged(run_dir) if r["time"] <= end), default=0)
    summary = harness.read_json(run_dir / "summary.json", {})
    attempts = summary.get("attempts", [])
    window.steps_run = summary.get("steps_executed")
    for kill in schedule.kills:
        failed = next((a for a in attempts if f"pid {kill['pid']} " in (a.get("cause") or "")), None)
        if failed and failed["number"] < len(attempts):
            kill["redone"] = redone(failed, attempts[failed["number"]])
    window.kills = schedule.kills
    if not schedule.stopped.is_set():
        window.error = window.error or "the run ended before its window"
    return window


def measure(args, storage: Path) -> list[harness.Trial]:
    return harness.alternate(
        list(SYSTEMS),
        args.repeats,
        lambda key, repeat: run_window(key, args, storage, repeat),
        lambda key: f"efficiency, {SYSTEMS[key]}, {args.efficiency:g} s",
    )


def noise(windows: list[harness.Trial]) -> str:
    """A warning when the runs without failures differ by more than 10% among themselves."""
    useful = [t.result.useful for t in windows if t.key == "none" and t.result.useful]
    if len(useful) < 2 or min(useful) >= 0.9 * max(useful):
        return ""
    return (
        f" The runs without failures differ by {max(useful) / min(useful):.1f}× among themselves (the machine's "
        "load): these efficiencies measure the load more than the recovery."
    )


def section(args, windows: list[harness.Trial]) -> str:
    """The page's section: a row per run, its efficiency relative to the median run without failures, and
    each system's median."""
    base = harness.median_of([t.result.useful for t in windows if t.key == "none" and t.result.useful])
    rows, summary = [], []
    for system, label in SYSTEMS.items():
        mine = sorted((t for t in windows if t.key == system), key=lambda t: t.repeat)
        effs = [100 * t.result.useful / base if base else None for t in mine]
        redone_all = [k["redone"] for t in mine for k in t.result.kills if "redone" in k]
        known = [e for e in effs if e is not None]
        summary.append(
            f"{label} {harness.spread(known, '.1f')}% (steps redone per kill {harness.spread(redone_all, 'g')})"
        )
        for t, eff in zip(mine, effs, strict=True):
            w = t.result
            redone = harness.spread([k["redone"] for k in w.kills if "redone" in k], "g")
            cells = [label, t.repeat, f"{t.load:.2f}", len(w.kills), redone, w.steps_run or "—", w.useful]
            rows.append([*cells, f"{w.useful / w.seconds:.2f}", "—" if eff is None else f"**{eff:.1f}%**"])
            if w.error:
                rows.append([label, t.repeat, f"{t.load:.2f}", f"problem: {w.error}", *[""] * 5])
    head = ["run", "repeat", "load before", "kills", "steps redone per kill", "steps begun (all attempts)"]
    head += ["useful steps (highest logged)", "useful steps / s", "efficiency (÷ no failure's median)"]
    minutes = f"{args.efficiency / 60:g} minute(s)"
    return f"""
## Training efficiency

{WORKERS} workers train the job above for a window of {args.efficiency:g} s each, timed from the first logged step
(start-up left out), one run after the other, the order reversed on every other repeat: with no failure; then
with a random rank SIGKILLed every {EVERY_S:g} s of the window, the first after {EVERY_S / 2:g} s (one hot spare,
replenished between kills), recovering from the replicas
(`checkpoint.interval=0`: no checkpoint is written, as the replicas make it safe to) and from the checkpoint
(`cluster.peer_recovery=false checkpoint.interval={CHECKPOINT_EVERY}`). Useful steps: the highest step logged
within the window (steps done twice count once); efficiency: that over the no-failure run's. A checkpoint every
{CHECKPOINT_EVERY} steps is a few seconds of training here, far more often than a real run would write one (hundreds
to thousands of steps): the save of this 0.9 M-parameter model is cheap, and a failure costs half an interval on
average, so this favours the checkpoint path. The issue asks for a 5-minute window; this one is {minutes},
to fit the benchmark's time on a shared 2-core machine, {args.repeats} run(s) each. ({TORCHFT}, for comparison.)

Medians (min–max) over the repeats: {"; ".join(summary)}.{noise(windows)}

{chr(10).join(harness.table(head, rows, "lrrrrrrrr"))}
"""
