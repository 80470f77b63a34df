"""distrain's DDP beside plain torchrun and Ray Train on the same job:  python jobs/bench/bench_ddp.py

All three run as commands on this machine with the same model, batches, optimizer and worker count, each
logging metrics every step: `jobs/train.py` (Ray workers), `torchrun --standalone jobs/bench/ddp_torchrun.py`
and `jobs/bench/ddp_raytrain.py` (the same loop under Ray Train's TorchTrainer), the order reversed on every
other repeat. Per run it takes the median step time after a warm-up (from the wall-clock `time` of
consecutive step records, so all per-step work counts, logging included) and the time from launching the
command to the first completed step. Writes docs/ddp.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import harness  # first: it keeps Ray on loopback
import torch

from distrain.testing import processes

GOAL = 1.02  # distrain's step time may be at most 2% above torchrun's, metrics logged every step
RUNNERS = {"distrain": "distrain (Ray)", "torchrun": "torchrun", "raytrain": "Ray Train"}
BASELINE = "torchrun"  # the other runners' ratios are over its figures
COMPARED = [r for r in RUNNERS if r != BASELINE]


@dataclass
class Result:
    step_s: float  # median wall-clock time between consecutive steps after the warm-up
    reported_step_s: float  # median of the step_time_s each runner measures itself
    first_step_s: float  # command launch → first completed step
    exit_s: float  # command launch → process exit (distrain also evaluates and checkpoints at the end)
    final_loss: float
    own_first_step_s: float | None = None  # distrain's summary.json first_step_s, timed inside the driver


def add_job_options(p: argparse.ArgumentParser, steps: int) -> None:
    """The DDP job every runner trains (`command` reads them): bench_startup times the same job."""
    p.add_argument("--workers", type=int, default=2, help="DDP ranks for every runner")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--model", default="nano", help="a conf/model/*.yaml name")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)


def parse_args(argv: list[str] | None = None):
    p = harness.parser(__doc__, "docs/ddp.md", repeats=5)
    add_job_options(p, steps=60)
    p.add_argument("--warmup", type=int, default=10, help="first steps left out of the step time")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds one run may take")
    args = harness.parse(p, argv)
    if args.smoke:
        args.steps, args.warmup, args.global_batch, args.micro_batch, args.seq_len = 4, 1, 8, 2, 32
    if torch.cuda.is_available() and args.workers > torch.cuda.device_count():
        p.error(f"--workers={args.workers} but this machine has {torch.cuda.device_count()} GPU(s)")
    if args.steps < args.warmup + 2:
        p.error(f"--steps={args.steps} leaves too few steps after --warmup={args.warmup}")
    return args


def precision() -> str:
    """What distrain's trainer.precision=auto picks: bf16 autocast on GPUs, fp32 on CPUs."""
    return "bf16" if torch.cuda.is_available() else "fp32"


class ExitAfterLastStep(RuntimeError):
    """A run logged every step, then its process failed on the way out: e.g. a gloo rank aborting in
    interpreter shutdown while a gloo thread still holds the last all-reduce's tensors (a PyTorch
    race that ddp_torchrun.py's final barrier makes rare). Not a training failure, but the run is
    done once more rather than its exit time trusted."""


def command(runner: str, args, storage: Path, name: str) -> tuple[list[str], dict[str, str]]:
    """The command line of one run, and what it adds to the environment."""
    if runner == "distrain":
        return [
            sys.executable,
            "jobs/train.py",
            f"model={args.model}",
            "strategy=ddp",
            f"run.storage={storage}",
            f"run.name={name}",  # a new run each time: an existing one would resume
            "logger.wandb.mode=disabled",
            "checkpoint.interval=0",
            "trainer.eval_interval=0",
            f"cluster.num_workers={args.workers}",
            f"trainer.max_steps={args.steps}",
            f"trainer.global_batch_size={args.global_batch}",
            f"trainer.micro_batch_size={args.micro_batch}",
            f"trainer.seq_len={args.seq_len}",
            f"trainer.precision={precision()}",
            "trainer.log_interval=1",  # metrics.jsonl gets every step, as the others print or report every step
        ], {}
    options = [f"--model={args.model}", f"--steps={args.steps}", f"--precision={precision()}"]
    options += [f"--global-batch={args.global_batch}", f"--micro-batch={args.micro_batch}", f"--seq-len={args.seq_len}"]
    if runner == "raytrain":  # it sets gloo on loopback in its workers' environment itself
        # A smoke's numbers measure nothing: its controller takes each step's report at once, not every 2 s
        # (the wait that `reading` explains), so that each step does not hold the smoke for 2 s.
        poll = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"} if args.smoke else {}
        return [sys.executable, "jobs/bench/ddp_raytrain.py", f"--workers={args.workers}", *options], poll
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={args.workers}"]
    # gloo on loopback, as distrain sets it for a local rendezvous (distrain/parallel/process_group.py)
    return [*torchrun, "jobs/bench/ddp_torchrun.py", *options], {"GLOO_SOCKET_IFNAME": "lo"}


def run_once(runner: str, repeat: int, args, storage: Path, attempt: int) -> Result:
    """One run; a failed one stops the benchmark with the end of its log."""
    name = f"{runner}-{repeat}-{attempt}"
    cmd, env = command(runner, args, storage, name)
    try:
        done = processes.run_command(cmd, storage / f"{name}.log", args.timeout, env)
    except processes.CommandTimeout as e:
        raise SystemExit(f"bench_ddp: {e}") from None
    if runner == "distrain":
        metrics = storage / name / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    else:  # rank 0's JSON lines (ddp_raytrain.py's driver prints them once Ray Train returns)
        records = [json.loads(line) for line in done.log.read_text().splitlines() if line.startswith('{"step"')]
    if done.rc != 0:
        if len(records) >= args.steps:
            lines = done.log.read_text().splitlines()
            cause = next((line for line in lines if "terminate" in line or "rror" in line), "")
            raise ExitAfterLastStep(f"{runner} exited with {done.rc} after its last step ({cause.strip()})")
        raise SystemExit(f"bench_ddp: {runner} (repeat {repeat}) exited with {done.rc}:\n{done.tail()}")
    result = measure(records, done.started, done.ended, args.warmup)
    if runner == "distrain":
        result.own_first_step_s = json.loads((storage / name / "summary.json").read_text())["first_step_s"]
    return result


def run(runner: str, repeat: int, args, storage: Path) -> Result:
    try:
        result = run_once(runner, repeat, args, storage, 1)
    except ExitAfterLastStep as e:
        print(f"bench_ddp: {e}; running it again", file=sys.stderr, flush=True)
        try:
            result = run_once(runner, repeat, args, storage, 2)
        except ExitAfterLastStep as again:
            raise SystemExit(f"bench_ddp: {again}") from None
    print(f"  step {result.step_s:.4f}s  first step {result.first_step_s:.1f}s  exit {result.exit_s:.1f}s", flush=True)
    return result


def measure(records: list[dict], started: float, ended: float, warmup: int) -> Result:
    """Median step time over steps warmup+1 .. last-1; the last step is left out because distrain's
    also runs the final validation, which the baseline does not do."""
    by_step = {r["step"]: r for r in records}
    last = max(by_step)
    deltas = [by_step[s]["time"] - by_step[s - 1]["time"] for s in range(warmup + 1, last)]
    reported = [by_step[s]["step_time_s"] for s in range(warmup + 1, last)]
    first = by_step[min(by_step)]["time"] - started
    return Result(statistics.median(deltas), statistics.median(reported), first, ended - started, by_step[last]["loss"])


# -- the page ----------------------------------------------------------------------------------------


def medians(trials: list[harness.Trial]) -> dict[str, dict[str, float]]:
    """runner → each figure's median over its runs."""
    keys = ("step_s", "reported_step_s", "first_step_s", "exit_s", "final_loss")
    return {
        runner: {k: statistics.median(getattr(t.result, k) for t in mine) for k in keys}
        for runner, mine in harness.by_key(trials).items()
    }


def paired_ratios(trials: list[harness.Trial], runner: str) -> list[float]:
    """runner / torchrun per repeat: the runs of a repeat ran back to back, so their ratio is less exposed
    to the machine's drift over the whole benchmark than the ratio of medians."""
    step = {(t.key, t.repeat): t.result.step_s for t in trials}
    return [step[runner, k] / step[BASELINE, k] for k in sorted({t.repeat for t in trials})]


def summary_table(trials: list[harness.Trial], tokens: int) -> list[str]:
    m = medians(trials)
    base = m[BASELINE]
    head = ["runner", "step time (s)", "tokens/s", "self-reported step (s)", "launch → first step (s)"]
    head += ["launch → exit (s)", "loss at last step", "step ratio per repeat: median (min–max)"]
    rows = [
        [
            RUNNERS[name],
            f"{s['step_s']:.4f}",
            f"{tokens / s['step_s']:,.0f}",
            f"{s['reported_step_s']:.4f}",
            f"{s['first_step_s']:.1f}",
            f"{s['exit_s']:.1f}",
            f"{s['final_loss']:.4f}",
            "",
        ]
        for name, s in m.items()
    ]
    for runner in COMPARED:
        r = m[runner]
        ratios = [f"{r[k] / base[k]:.3f}" for k in ("reported_step_s", "first_step_s", "exit_s")]
        pairs = harness.spread(paired_ratios(trials, runner), ".3f")
        label = f"**{RUNNERS[runner]} / {RUNNERS[BASELINE]}**"
        rows.append([label, f"**{r['step_s'] / base['step_s']:.3f}**", "", *ratios, "", pairs])
    return harness.table(head, rows)


def repeat_table(trials: list[harness.Trial]) -> list[str]:
    by = {(t.key, t.repeat): t for t in trials}
    head = ["repeat", "order", *(f"step {r} (s)" for r in RUNNERS), *(f"{r} / {BASELINE}" for r in COMPARED)]
    head += [*(f"first step {r} (s)" for r in RUNNERS), *(f"load before {r}" for r in RUNNERS)]
    repeats = sorted({t.repeat for t in trials})
    pairs = {runner: dict(zip(repeats, paired_ratios(trials, runner), strict=True)) for runner in COMPARED}
    rows = []
    for k in repeats:
        mine = [by[r, k] for r in RUNNERS]
        order = ", ".join(t.key for t in sorted(mine, key=lambda t: t.position))
        rows.append(
            [k, order, *(f"{t.result.step_s:.4f}" for t in mine), *(f"{pairs[r][k]:.3f}" for r in COMPARED)]
            + [*(f"{t.result.first_step_s:.1f}" for t in mine), *(f"{t.load:.2f}" for t in mine)]
        )
    return harness.table(head, rows, "rl" + "r" * (len(head) - 2))


def reading(trials: list[harness.Trial]) -> str:
    m = medians(trials)
    d, r, t = m["distrain"], m["raytrain"], m[BASELINE]
    ratio = {runner: m[runner]["step_s"] / t["step_s"] for runner in COMPARED}
    pairs = {runner: paired_ratios(trials, runner) for runner in COMPARED}
    gap = max(abs(m[runner]["final_loss"] - t["final_loss"]) for runner in COMPARED)
    own = statistics.median(x.result.own_first_step_s for x in trials if x.key == "distrain")
    same = "are identical" if gap == 0 else f"differ by at most {gap:.1e}"
    parity = (
        f"The losses at the last step {same}: all three did the same training, so the comparison is of the same work."
        if gap < 1e-3
        else f"The losses at the last step differ by up to {gap:.3g}, more than rounding: check that the "
        "runners still train the same way before trusting the ratios."
    )

    def versus(runner: str) -> str:
        p = pairs[runner]
        return (
            f"{ratio[runner]:.3f}× torchrun's (median of the repeats' own ratios {statistics.median(p):.3f}, "
            f"range {min(p):.3f}–{max(p):.3f})"
        )

    return (
        f"distrain's step time is {versus('distrain')}, {'within' if ratio['distrain'] <= GOAL else 'outside'} "
        f"the goal of ≤ {GOAL}× with metrics logged every step. Ray Train's is {versus('raytrain')}, "
        f"{r['step_s']:.2f} s a step. {parity}\n\n"
        "Ray Train's `ray.train.report` is collective (the ranks first agree on a checkpoint name through a Ray "
        "actor), then puts the step's metrics on a queue of one result per worker, which its controller empties "
        "at most once per `RAY_TRAIN_HEALTH_CHECK_INTERVAL_S` (2 s by default): reporting every step holds each "
        "step, once the queue is full, until the controller has taken the previous one. Its self-reported step "
        f"time ({r['reported_step_s']:.4f} s) leaves that wait out.\n\n"
        f"distrain reaches its first step {d['first_step_s'] - t['first_step_s']:.1f} s later than torchrun, Ray "
        f"Train {r['first_step_s'] - t['first_step_s']:.1f} s later: that is the drivers' imports (Ray; Ray "
        "Train's also torch), Ray's start of a local cluster (GCS, raylet, agents; Ray Train's also its "
        "dashboard, which its placement-group cleaner asks), the placement group and the worker actors' "
        "processes (Ray Train's behind its controller actor), all before the same process-group rendezvous, "
        "model build and data load that torchrun does. Launch → exit also includes distrain's final "
        "validation and checkpoint and the "
        "shutdown of the Ray cluster. distrain's own "
        f"`first_step_s` in summary.json says {own:.1f} s: its clock starts in `launch.train`, after "
        "Python, Hydra and the driver's imports (Ray), so it leaves out "
        f"{d['first_step_s'] - own:.1f} s of the command's start."
    )


def job_settings(args) -> str:
    """The job `add_job_options` describes, as a page states it (bench_startup's page too)."""
    accum = args.global_batch // (args.micro_batch * args.workers)
    return (
        f"model `{args.model}`, {args.workers} DDP ranks, global batch {args.global_batch} × {args.seq_len} tokens, "
        f"micro-batch {args.micro_batch} ({accum} per rank and step), {precision()}, {args.steps} steps, "
        "`OMP_NUM_THREADS=1`"
    )


def body(args, trials: list[harness.Trial]) -> str:
    return "\n".join(
        [
            "distrain's DDP (`jobs/train.py`: an embedded Ray cluster, one worker actor per rank) beside the",
            "plain DDP script a user would write by hand (`jobs/bench/ddp_torchrun.py` under",
            "`torchrun --standalone`) and the same script's loop under Ray Train's `TorchTrainer`",
            "(`jobs/bench/ddp_raytrain.py`: a local Ray cluster on loopback, distrain's CPU share and torch threads",
            "per worker): the same model, initial weights, batches, AdamW, LR schedule, gradient accumulation",
            "(`no_sync`), clipping, DDP options and per-step loss all-reduce, run one after the other on the",
            "same machine. Each logs metrics every step: distrain to metrics.jsonl (`trainer.log_interval=1`),",
            "torchrun's rank 0 to its console, Ray Train's ranks through `ray.train.report`.",
            "",
            f"- Settings: {job_settings(args)}; distrain with `logger.wandb.mode=disabled "
            "checkpoint.interval=0 trainer.eval_interval=0 trainer.log_interval=1`.",
            f"- Step time: median over steps {args.warmup + 1}–{args.steps - 1} of the wall-clock time between "
            "consecutive step records (so logging counts); *self-reported* is the median of each runner's own "
            "`step_time_s` (distrain's leaves out most of its per-step logging, Ray Train's its "
            "`ray.train.report`). Launch → first step: from starting the command to the first step's record. "
            f"Each cell is the median over {args.repeats} run(s) of each, the order reversed on every other "
            "repeat; a ratio row's last cell is the median and range of the repeats' own step-time ratios.",
            "",
            *summary_table(trials, args.global_batch * args.seq_len),
            "",
            "Each repeat (its runs back to back):",
            "",
            *repeat_table(trials),
            "",
            reading(trials),
        ]
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    page = harness.Page("DDP: distrain vs torchrun vs Ray Train", args)
    with harness.storage(args) as storage:
        trials = harness.alternate(list(RUNNERS), args.repeats, lambda runner, k: run(runner, k, args, storage))
    print("\n" + "\n".join(summary_table(trials, args.global_batch * args.seq_len)))
    for runner in COMPARED:
        pairs = ", ".join(f"{r:.3f}" for r in paired_ratios(trials, runner))
        print(f"ratio {runner}/{BASELINE} per repeat: {pairs}" + (f" (goal ≤ {GOAL})" if runner == "distrain" else ""))
    page.write(body(args, trials), trials)


if __name__ == "__main__":
    main()
