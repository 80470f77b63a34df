"""Pipeline bubble of every schedule, measured against theory:  python jobs/bench/bench_bubble.py

Runs every schedule distrain offers (`distrain.strategy.pipeline.SCHEDULES`) through `ParallelModel` in `pp` gloo
processes on 127.0.0.1 (no Ray: a parallel-layer measurement) and times, on each rank, the calls that
compute: its stages' forward, backward (input and weight parts) and the loss. A rank's idle fraction is
1 − compute / step, the step being the slowest rank's wall time of the schedule's `step` (all ranks start
it together after a barrier), beside the textbook bubble (p − 1) / (v·m + p − 1). Writes docs/bubble.md
and its plot, docs/bubble.svg (its numbers in docs/bubble.json: `--replot docs/bubble.json` redraws it).
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import harness  # first: it keeps Ray on loopback
import torch
import torch.distributed as dist
from plots import figure, log2_x  # jobs/bench/plots.py, beside this script

from distrain.config import ModelConfig, StrategyConfig
from distrain.model.llama import Transformer
from distrain.parallel.parallelize import ParallelModel
from distrain.strategy.pipeline import SCHEDULES, stage_layers
from distrain.strategy.resolve import layout_of
from distrain.testing import processes
from distrain.train.learner import cross_entropy

# The stage calls a schedule makes that compute; the rest of its time is spent waiting on peers.
STAGE_COMPUTE = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
COLOURS = {"gpipe": "#1f77b4", "1f1b": "#ff7f0e", "interleaved_1f1b": "#2ca02c", "looped_bfs": "#d62728"}
COLOURS["interleaved_zb"] = "#9467bd"
DISTURBED = 0.9  # a rank computing with its core less than this share of the time: the cell is starred


@dataclass
class BubbleSetup:
    pp: int = 2
    micro_batches: list[int] = field(default_factory=lambda: [2, 4, 8, 16])
    dim: int = 256
    n_layers: int = 8
    seq_len: int = 128
    micro_batch_size: int = 2
    steps: int = 8  # timed steps per schedule, micro-batch count and repeat
    warmup: int = 1  # untimed first steps (the first one also infers the stages' shapes)
    repeats: int = 2  # passes over every (schedule, m), the order reversed on every other one

    @property
    def model(self) -> ModelConfig:
        heads = self.dim // 64 or 1
        return ModelConfig(name="bubble", dim=self.dim, n_layers=self.n_layers, n_heads=heads, ffn_dim=3 * self.dim)

    def cells(self) -> list[tuple[str, int]]:
        return [(s, m) for s in SCHEDULES for m in self.micro_batches if valid(s, self.pp, m)]


class ComputeClock:
    """Wall seconds this rank spends inside the calls it wraps, and the CPU seconds its thread got
    meanwhile: their ratio falls below 1 when another process took the rank's core."""

    def __init__(self) -> None:
        self.seconds = self.cpu_seconds = 0.0

    def wrap(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.cpu_seconds += time.thread_time() - cpu

        return timed


def valid(schedule: str, pp: int, m: int) -> bool:
    """What distrain's validation allows: m ≥ pp, and a multiple of pp for the multi-stage schedules."""
    return m >= pp and (not SCHEDULES[schedule].multi_stage or m % pp == 0)


def stages_per_rank(schedule: str) -> int:
    return 2 if SCHEDULES[schedule].multi_stage else 1


Timing = tuple[float, float, float]  # one step on one rank: compute wall seconds, compute CPU seconds, step seconds


def time_schedule(setup: BubbleSetup, schedule: str, m: int, device: torch.device) -> list[Timing]:
    """This rank's timing of each timed step; the step is the pipeline's, its slowest rank's."""
    model = Transformer(setup.model, setup.seq_len, seed=0)
    v = stages_per_rank(schedule)
    strategy = StrategyConfig(dp_replicate=1, pp=setup.pp, schedule=schedule, stages_per_rank=v)
    layout = layout_of(pp=setup.pp, micro_batches=m, stages_per_rank=v, schedule=schedule)
    clock = ComputeClock()
    parallel = ParallelModel(model, strategy, layout, device, False, clock.wrap(cross_entropy))
    for stage in parallel.pipeline.stages:
        for name in STAGE_COMPUTE:
            setattr(stage, name, clock.wrap(getattr(stage, name)))
    tokens = torch.randint(0, setup.model.vocab_size, (m * setup.micro_batch_size, setup.seq_len))
    timed = []
    for i in range(setup.warmup + setup.steps):
        dist.barrier()
        clock.seconds = clock.cpu_seconds = 0.0
        start = time.perf_counter()
        parallel.forward_backward(tokens, tokens)
        elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= setup.warmup:
            timed.append((clock.seconds, clock.cpu_seconds, elapsed.item()))
    return timed


def bubble_rank(rank: int, device: torch.device, setup: BubbleSetup) -> dict:
    """One pipeline rank: every schedule at every micro-batch count, in alternating order over the repeats;
    "schedule/m" → the timed steps of every repeat, and the load before each (on rank 0)."""
    cores = sorted(os.sched_getaffinity(0))
    if setup.pp <= len(cores):
        os.sched_setaffinity(0, {cores[rank]})  # a core of its own: no rank waits for a CPU, only for its peers

    def run(cell: tuple[str, int], repeat: int) -> list[Timing]:
        if rank == 0:
            print(f"bench_bubble: pass {repeat}/{setup.repeats}: {cell[0]}, m = {cell[1]}", flush=True)
        return time_schedule(setup, *cell, device)

    results: dict[str, Any] = {}
    for trial in harness.alternate(setup.cells(), setup.repeats, run, quiet=True):
        key = "/".join(map(str, trial.key))
        results.setdefault(key, {"timings": [], "loads": []})
        results[key]["timings"] += trial.result
        results[key]["loads"].append(trial.load)
    return results


def theory(schedule: str, pp: int, m: int) -> float:
    """Bubble of GPipe/1F1B, (p − 1) / (m + p − 1); with v stages per rank (interleaved, looped BFS)
    each stage's work is 1/v as long, so (p − 1) / (v·m + p − 1). Balanced stages assumed; zero-bubble
    schedules aim below it by filling the bubble with deferred weight gradients."""
    return (pp - 1) / (stages_per_rank(schedule) * m + pp - 1)


def measure_bubble(setup: BubbleSetup) -> dict[str, dict[int, dict[str, Any]]]:
    """schedule → m → idle (median over the timed steps of the mean over ranks), step seconds
    (median), theory; the least CPU share of any rank's compute (below 1 when other processes took the
    rank's core, which stretches its compute and makes its peers wait: idle that is not bubble); the
    balance, the least-computing rank's compute over the most-computing one's (median over steps); and
    the load before each pass."""
    ranks = processes.spawn_ranks(bubble_rank, setup.pp, setup)
    results: dict[str, dict[int, dict[str, Any]]] = {}
    for key in ranks[0]:
        schedule, m = key.split("/")
        timings = [r[key]["timings"] for r in ranks]  # rank → step → (wall, cpu, step)
        steps = [[t[i] for t in timings] for i in range(len(timings[0]))]  # step → rank → ...
        results.setdefault(schedule, {})[int(m)] = {
            "idle": statistics.median(statistics.fmean(1 - wall / step for wall, _, step in s) for s in steps),
            "step_s": statistics.median(s[0][2] for s in steps),
            "theory": theory(schedule, setup.pp, int(m)),
            "cpu_share": min(sum(cpu for _, cpu, _ in t) / sum(wall for wall, _, _ in t) for t in timings),
            "balance": statistics.median(min(wall for wall, _, _ in s) / max(wall for wall, _, _ in s) for s in steps),
            "loads": ranks[0][key]["loads"],
        }
    return results


# -- the page ----------------------------------------------------------------------------------------


def cell(point: dict[str, Any]) -> str:
    """'measured (theory)', starred where other processes held a rank's core for over 10% of its compute."""
    star = "*" if point["cpu_share"] < DISTURBED else ""
    return f"{point['idle']:.3f}{star} ({point['theory']:.3f})"


def table(results: dict[str, dict[int, dict[str, Any]]], setup: BubbleSetup) -> list[str]:
    """One row per schedule; per micro-batch count m, the idle fraction 'measured (theory)', then the
    step's seconds, then the load before its runs."""
    ms = setup.micro_batches
    head = ["schedule", "v", *(f"idle, m = {m}" for m in ms), *(f"step (s), m = {m}" for m in ms), "load"]
    rows = []
    for schedule, by_m in results.items():
        loads = [x for p in by_m.values() for x in p["loads"]]
        cells = [cell(by_m[m]) if m in by_m else "—" for m in ms]
        cells += [f"{by_m[m]['step_s']:.2f}" if m in by_m else "—" for m in ms]
        rows.append([schedule, stages_per_rank(schedule), *cells, f"{min(loads):.2f}–{max(loads):.2f}"])
    return harness.table(head, rows)


def plot_data(results: dict[str, dict[int, dict[str, Any]]], setup: BubbleSetup) -> dict:
    """What the plot shows: pp, the micro-batch counts, and each schedule's idle fraction per m."""
    idle = {s: {str(m): p["idle"] for m, p in sorted(by_m.items())} for s, by_m in results.items()}
    return {"pp": setup.pp, "micro_batches": setup.micro_batches, "idle": idle}


def draw(data: dict):  # noqa: ANN201  (a matplotlib Figure)
    """Idle fraction against m on a log₂ axis, one coloured line per schedule, the theory for
    v = 1 and v = 2 in black, dashed and dotted."""
    pp, ms = data["pp"], data["micro_batches"]
    lo, hi = ms[0], max(ms[-1], 2 * ms[0])
    fig, ax = figure(7.6, 4.4)
    curve = [lo * (hi / lo) ** (k / 40) for k in range(41)]
    for v, style in ((1, "--"), (2, ":")):
        ax.plot(curve, [(pp - 1) / (v * m + pp - 1) for m in curve], "k", linestyle=style,
                label=f"theory (p−1)/({'' if v == 1 else v}m+p−1)")  # fmt: skip
    for schedule, by_m in data["idle"].items():
        points = sorted((int(m), idle) for m, idle in by_m.items())
        ax.plot(*zip(*points, strict=True), color=COLOURS[schedule], marker="o",
                label=f"{schedule} (v = {stages_per_rank(schedule)})")  # fmt: skip
    log2_x(ax, ms)
    ax.set_xlim(lo, hi)
    ax.set_ylim(bottom=0)
    ax.set_title(f"Pipeline bubble: pp = {pp}, measured vs theory", loc="left")
    ax.set_xlabel("micro-batches per step, m (log scale)")
    ax.set_ylabel("idle fraction of a rank")
    ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), frameon=False)
    return fig


def reading(results: dict[str, dict[int, dict[str, Any]]], setup: BubbleSetup) -> str:
    cores = len(os.sched_getaffinity(0))
    points = [p for by_m in results.values() for p in by_m.values()]
    clean = [p["idle"] - p["theory"] for p in points if p["cpu_share"] >= DISTURBED]
    below = [f"{s} at m = {m}" for s, by_m in results.items() for m, p in by_m.items() if p["idle"] < p["theory"]]
    comparison = (
        f"Measured minus theory: {statistics.median(clean):+.3f} (median over the {len(clean)} unstarred cells of "
        f"{len(points)}; range {min(clean):+.3f} to {max(clean):+.3f})."
        if clean
        else "Every cell is starred: other processes held the cores throughout, so these idle fractions include "
        "their interference and say little against theory; rerun on a quiet machine."
    )
    if below:
        comparison += (
            f" Below theory: {', '.join(below)} (interleaved_zb's deferred weight gradients fill part of the bubble, "
            "which the formula does not count; elsewhere, noise)."
        )
    last = {s: by_m[max(by_m)]["idle"] for s, by_m in results.items()}
    m_last = max(max(by_m) for by_m in results.values())
    return (
        f"{comparison} At m = {m_last}: "
        + ", ".join(f"{s} {v:.3f}" for s, v in last.items())
        + ". Theory counts only the pipeline's fill and drain, with equal stages. A real step adds unequal "
        f"ranks: the less loaded one computes {statistics.median(p['balance'] for p in points):.0%} as long as the "
        "other (median over the cells; the last stage also runs the head and the loss, and a core's speed varies "
        "from step to step), and waits for it at every micro-batch. It adds the send and receive of every "
        "micro-batch (gloo's threads need a core, and both are computing), the schedule's Python bookkeeping and "
        "the gradient scaling after the last backward, all outside the timed calls. GPipe and 1F1B have the same "
        "bubble in theory (1F1B holds fewer activations, it does not idle less); v = 2 halves the fill and drain."
        + (
            f" pp = {2 * setup.pp} is not measured here: {2 * setup.pp} single-threaded ranks on {cores} cores take "
            "turns, so a rank's compute would include its waits for a core and its idle fraction would not "
            f"isolate the bubble; `--pp {2 * setup.pp}` measures it on a machine with as many cores."
            if cores < 2 * setup.pp
            else ""
        )
    )


def body(results: dict[str, dict[int, dict[str, Any]]], setup: BubbleSetup, plot: str) -> str:
    splits = {v: [len(r) for r in stage_layers(setup.n_layers, setup.pp * v)] for v in (1, 2)}
    cores = len(os.sched_getaffinity(0))
    placement = (
        "each pinned to a core of its own"
        if setup.pp <= cores
        else f"on {cores} cores: oversubscribed, so a rank waiting for a core counts as computing and the idle "
        "fraction is not the bubble alone"
    )
    m = setup.model
    return "\n".join(
        [
            f"Model dim {m.dim}, {m.n_layers} layers, {m.n_heads} heads, ffn {m.ffn_dim}, vocab {m.vocab_size}, "
            f"sequence {setup.seq_len}, micro-batches of {setup.micro_batch_size} sequences, fp32, through "
            f"`ParallelModel` on pp = {setup.pp} gloo processes with one thread, {placement} (no Ray). distrain "
            f"splits the blocks into stages of {splits[1]} blocks (v = 1) and {splits[2]} (v = 2, rank r holding "
            f"stages r and r + {setup.pp}), counting the embedding and the head as a block each. Each rank times "
            "its compute: its stages' `forward_one_chunk`, `backward_one_chunk`, `backward_weight_one_chunk` and "
            "the loss. Idle = 1 − compute / step, the step being the slowest rank's wall time of the schedule's "
            f"`step`, started after a barrier; mean over ranks, median over {setup.steps} timed steps (after "
            f"{setup.warmup} warm-up) in each of {setup.repeats} pass(es) over every cell, the order of the cells "
            "reversed on every other pass. Cells: measured (theory (p − 1)/(v·m + p − 1), v = stages per rank); "
            f"* marks a cell where another process held a rank's core for more than {1 - DISTURBED:.0%} of its "
            "compute time. Load: the 1-minute load average before the row's runs.",
            "",
            *table(results, setup),
            "",
            f"![idle fraction against micro-batches per schedule, with theory]({plot})",
            "",
            reading(results, setup),
        ]
    )


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, "docs/bubble.md", repeats=2, plot=True)
    d = BubbleSetup()
    p.add_argument("--pp", type=int, default=d.pp, help="pipeline ranks (processes)")
    p.add_argument("--micro-batches", type=int, nargs="+", default=d.micro_batches, help="micro-batch counts m")
    p.add_argument("--steps", type=int, default=d.steps, help="timed steps per schedule, m and pass")
    args = harness.parse(p, argv)
    if harness.replot(args, draw):
        return
    setup = BubbleSetup(args.pp, sorted(args.micro_batches), steps=args.steps, repeats=args.repeats)
    if args.smoke:
        setup = BubbleSetup(args.pp, [2], dim=64, n_layers=4, seq_len=32, steps=1, repeats=1)
    page = harness.Page("Pipeline bubble: measured against theory", args)
    results = measure_bubble(setup)
    print(asdict(setup))
    print("\n".join(table(results, setup)))
    page.write(body(results, setup, page.plot), plot=(draw, plot_data(results, setup)))


if __name__ == "__main__":
    main()
