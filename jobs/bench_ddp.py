"""distrain's DDP beside a plain torchrun DDP script, in one invocation:  python jobs/bench_ddp.py

Both run as subprocesses on this machine with the same model, batches, optimizer and worker count:
`jobs/train.py` (Ray workers) and `torchrun --standalone jobs/ddp_torchrun.py`. Per run it takes the
median step time after a warm-up (from the wall-clock `time` of consecutive step records, so all
per-step work counts, logging included) and the time from launching the command to the first
completed step. It prints a table and writes it, with the machine and settings, to docs/ddp.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from machine import describe, machine  # jobs/machine.py, beside this script

ROOT = Path(__file__).resolve().parent.parent
GOAL = 1.05  # distrain's step time may be at most 5% above torchrun's


@dataclass
class Result:
    runner: str
    repeat: int
    step_s: float  # median wall-clock time between consecutive steps after the warm-up
    reported_step_s: float  # median of the step_time_s each runner measures itself
    first_step_s: float  # command launch → first completed step
    exit_s: float  # command launch → process exit (distrain also evaluates and checkpoints at the end)
    final_loss: float
    steps: int
    own_first_step_s: float | None = None  # distrain's summary.json first_step_s, timed inside the driver


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2, help="DDP ranks for both runners")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--model", default="nano", help="a conf/model/*.yaml name")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=10, help="first steps left out of the step time")
    p.add_argument("--repeats", type=int, default=3, help="runs of each, alternating which goes first")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds one run may take")
    p.add_argument("--out", default="docs/ddp.md", help="markdown file to write ('' for none)")
    args = p.parse_args()
    if torch.cuda.is_available() and args.workers > torch.cuda.device_count():
        p.error(f"--workers={args.workers} but this machine has {torch.cuda.device_count()} GPU(s)")
    if args.steps < args.warmup + 3:
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


def launch(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> tuple[float, float, int]:
    """Run cmd from the repository root with one torch thread per rank and no Ray address (so
    distrain starts its own local cluster, as a user's first run would); return launch and exit
    times and the exit status."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    env.pop("RAY_ADDRESS", None)
    with open(log, "w") as out:
        started = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            _reap(proc.pid)
            tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
            message = f"bench_ddp: {shlex.join(cmd)} ran past --timeout={timeout:g}s:\n{tail}"
            raise SystemExit(message) from None
        ended = time.time()
        _reap(proc.pid)
    return started, ended, rc


def finish(
    runner: str,
    repeat: int,
    cmd: list[str],
    log: Path,
    run: tuple[float, float, int],
    records: list[dict],
    args: argparse.Namespace,
) -> Result:
    """The run's measurements; a failed run stops the benchmark with the end of its log."""
    started, ended, rc = run
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        message = f"{runner} (repeat {repeat}) exited with {rc}"
        if len(records) >= args.steps:
            lines = log.read_text().splitlines()
            cause = next((line for line in lines if "terminate" in line or "rror" in line), "")
            raise ExitAfterLastStep(f"{message} after its last step ({cause.strip()})")
        raise SystemExit(f"bench_ddp: {shlex.join(cmd)} exited with {rc}:\n{tail}")
    return measure(runner, repeat, records, started, ended, args.warmup)


def _session(sid: int) -> list[int]:
    """PIDs still alive in session `sid`: every process a run started keeps its session (Ray's own
    processes only change their process group), so this finds leftovers by id, not by name."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def _reap(sid: int, grace_s: float = 20.0) -> None:
    """Wait for a finished run's processes (Ray's cluster shuts down after its driver) so the next
    run gets the whole machine; terminate by PID any that outlive the grace period."""
    deadline = time.time() + grace_s
    while (left := _session(sid)) and time.time() < deadline:
        time.sleep(0.2)
    for pid in left:
        print(f"bench_ddp: process {pid} outlived its run by {grace_s:g}s; terminating it", file=sys.stderr)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def _stop(proc: subprocess.Popen) -> None:
    """End a run that hangs: its own process group (its session), terminate, then kill."""
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def measure(runner: str, repeat: int, records: list[dict], started: float, ended: float, warmup: int) -> Result:
    """Median step time over steps warmup+1 .. last-1; the last step is left out because distrain's
    also runs the final validation, which the baseline does not do."""
    by_step = {r["step"]: r for r in records}
    last = max(by_step)
    deltas = [by_step[s]["time"] - by_step[s - 1]["time"] for s in range(warmup + 1, last)]
    reported = [by_step[s]["step_time_s"] for s in range(warmup + 1, last)]
    return Result(
        runner,
        repeat,
        statistics.median(deltas),
        statistics.median(reported),
        by_step[min(by_step)]["time"] - started,
        ended - started,
        by_step[last]["loss"],
        last,
    )


def run_distrain(args: argparse.Namespace, tmp: Path, repeat: int, attempt: int) -> Result:
    name = f"distrain-{repeat}-{attempt}"  # a new run each time: an existing one would resume
    cmd = [
        sys.executable,
        "jobs/train.py",
        f"model={args.model}",
        "strategy=ddp",
        f"run.storage={tmp}",
        f"run.name={name}",
        "logger.wandb.mode=disabled",
        "checkpoint.interval=0",
        "trainer.eval_interval=0",
        f"cluster.num_workers={args.workers}",
        f"trainer.max_steps={args.steps}",
        f"trainer.global_batch_size={args.global_batch}",
        f"trainer.micro_batch_size={args.micro_batch}",
        f"trainer.seq_len={args.seq_len}",
        f"trainer.precision={precision()}",
    ]
    log = tmp / f"{name}.log"
    run = launch(cmd, log, args.timeout)
    metrics = tmp / name / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    result = finish("distrain", repeat, cmd, log, run, records, args)
    result.own_first_step_s = json.loads((tmp / name / "summary.json").read_text())["first_step_s"]
    return result


def run_torchrun(args: argparse.Namespace, tmp: Path, repeat: int, attempt: int) -> Result:
    name = f"torchrun-{repeat}-{attempt}"
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [
        torchrun,
        "--standalone",
        f"--nproc_per_node={args.workers}",
        "jobs/ddp_torchrun.py",
        f"--model={args.model}",
        f"--steps={args.steps}",
        f"--global-batch={args.global_batch}",
        f"--micro-batch={args.micro_batch}",
        f"--seq-len={args.seq_len}",
        f"--precision={precision()}",
    ]
    log = tmp / f"{name}.log"
    # gloo on loopback, as distrain sets it for a local rendezvous (distrain/parallel/process_group.py)
    run = launch(cmd, log, args.timeout, {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")})
    records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith('{"step"')]
    return finish("torchrun", repeat, cmd, log, run, records, args)


def summarise(results: list[Result], runner: str) -> dict:
    mine = [r for r in results if r.runner == runner]
    return {
        k: statistics.median(getattr(r, k) for r in mine)
        for k in ("step_s", "reported_step_s", "first_step_s", "exit_s", "final_loss")
    }


def table(args: argparse.Namespace, results: list[Result]) -> tuple[list[str], float]:
    """The markdown table of medians over the repeats, and distrain's step-time ratio to torchrun."""
    tokens = args.global_batch * args.seq_len
    d, t = summarise(results, "distrain"), summarise(results, "torchrun")
    ratio = d["step_s"] / t["step_s"]
    rows = [
        "| runner | step time (s) | tokens/s | self-reported step (s) | launch → first step (s) "
        "| launch → exit (s) | loss at last step |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, s in (("distrain (Ray)", d), ("torchrun", t)):
        rows.append(
            f"| {name} | {s['step_s']:.4f} | {tokens / s['step_s']:,.0f} "
            f"| {s['reported_step_s']:.4f} | {s['first_step_s']:.1f} | {s['exit_s']:.1f} "
            f"| {s['final_loss']:.4f} |"
        )
    rows.append(
        f"| **distrain / torchrun** | **{ratio:.3f}** | "
        f"| {d['reported_step_s'] / t['reported_step_s']:.3f} "
        f"| {d['first_step_s'] / t['first_step_s']:.2f} | {d['exit_s'] / t['exit_s']:.2f} | |"
    )
    return rows, ratio


def paired_ratios(results: list[Result]) -> list[float]:
    """distrain / torchrun per repeat: the two runs of a repeat ran back to back, so their ratio is
    less exposed to the machine's drift over the whole benchmark than the ratio of medians."""
    step = {(r.runner, r.repeat): r.step_s for r in results}
    return [step["distrain", k] / step["torchrun", k] for k in sorted({r.repeat for r in results})]


def per_repeat_rows(results: list[Result]) -> list[str]:
    rows = [
        "| repeat | first | step distrain (s) | step torchrun (s) | ratio | first step distrain (s) "
        "| first step torchrun (s) |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    by = {(r.runner, r.repeat): r for r in results}
    for k, ratio in zip(sorted({r.repeat for r in results}), paired_ratios(results), strict=True):
        d, t = by["distrain", k], by["torchrun", k]
        first = "distrain" if k % 2 else "torchrun"
        rows.append(
            f"| {k} | {first} | {d.step_s:.4f} | {t.step_s:.4f} | {ratio:.3f} | {d.first_step_s:.1f} "
            f"| {t.first_step_s:.1f} |"
        )
    return rows


def markdown(args: argparse.Namespace, info: dict, results: list[Result], command: str) -> str:
    rows, ratio = table(args, results)
    d, t = summarise(results, "distrain"), summarise(results, "torchrun")
    accum = args.global_batch // (args.micro_batch * args.workers)
    pairs = paired_ratios(results)
    verdict = "within" if ratio <= GOAL else "outside"
    gap = abs(d["final_loss"] - t["final_loss"])
    own = statistics.median(r.own_first_step_s for r in results if r.runner == "distrain")
    same = "are identical" if gap == 0 else f"differ by {gap:.1e}"
    parity = (
        f"The losses at the last step {same}: both did the same training, so the comparison is of the same work."
        if gap < 1e-3
        else f"The losses at the last step differ by {gap:.3g}, more than rounding: check that both "
        "runners still train the same way before trusting the ratio."
    )
    return "\n".join(
        [
            "# DDP: distrain vs torchrun",
            "",
            "distrain's DDP (`jobs/train.py`: an embedded Ray cluster, one worker actor per rank) beside the",
            "plain DDP script a user would write by hand (`jobs/ddp_torchrun.py` under",
            "`torchrun --standalone`): the same model, initial weights, batches, AdamW, LR schedule,",
            "gradient accumulation (`no_sync`), clipping, DDP options and per-step loss all-reduce, run",
            "one after the other on the same machine.",
            "",
            "```bash",
            command,
            "```",
            "",
            f"- Machine: {describe(info)}; 1-minute load average before the runs {info['load']:.2f}.",
            f"- Settings: model `{args.model}`, {args.workers} DDP ranks, global batch {args.global_batch} × "
            f"{args.seq_len} tokens, micro-batch {args.micro_batch} ({accum} micro-batch(es) per rank and step), "
            f"{precision()}, {args.steps} steps, `OMP_NUM_THREADS=1`; distrain with `logger.wandb.mode=disabled "
            f"checkpoint.interval=0 trainer.eval_interval=0`.",
            f"- Step time: median over steps {args.warmup + 1}–{args.steps - 1} of the wall-clock time between "
            "consecutive step records (so logging counts); *self-reported* is the median of each runner's own "
            "`step_time_s` (distrain's leaves out most of its per-step logging). Launch → first step: from "
            "starting the command to the first step's record. Each cell is the median over "
            f"{args.repeats} run(s) of each, alternating which ran first.",
            "",
            *rows,
            "",
            "Each repeat (its two runs back to back):",
            "",
            *per_repeat_rows(results),
            "",
            f"distrain's step time is {ratio:.3f}× torchrun's (median of the repeats' own ratios "
            f"{statistics.median(pairs):.3f}, range {min(pairs):.3f}–{max(pairs):.3f}), {verdict} the goal of "
            f"≤ {GOAL}×. {parity} "
            f"distrain reaches its first step {d['first_step_s'] - t['first_step_s']:.1f} s later: "
            "that is the driver's imports (torch, ray), Ray's start of a local cluster (GCS, raylet, agents), "
            "the placement group and the worker actors' processes, all before the same process-group "
            "rendezvous, model build and data load that torchrun does. Launch → exit also includes "
            "distrain's final validation and checkpoint and the shutdown of the Ray cluster. distrain's own "
            f"`first_step_s` in summary.json says {own:.1f} s: its clock starts in `launch.train`, after "
            "Python, Hydra and the driver's imports (torch, ray), so it leaves out "
            f"{d['first_step_s'] - own:.1f} s of the command's start.",
            "",
            "A comparison with Ray Train's `TorchTrainer` (the same script under Ray's own DDP launcher) is not "
            "yet included.",
            "",
        ]
    )


def main() -> None:
    args = parse_args()
    exe = os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT)) else sys.executable
    command = shlex.join([exe, "jobs/bench_ddp.py", *sys.argv[1:]])
    info = machine()
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="bench_ddp_") as tmp:
        for repeat in range(1, args.repeats + 1):
            order = (run_distrain, run_torchrun) if repeat % 2 else (run_torchrun, run_distrain)
            for run in order:
                try:
                    result = run(args, Path(tmp), repeat, 1)
                except ExitAfterLastStep as e:
                    print(f"bench_ddp: {e}; running it again", file=sys.stderr, flush=True)
                    try:
                        result = run(args, Path(tmp), repeat, 2)
                    except ExitAfterLastStep as again:
                        raise SystemExit(f"bench_ddp: {again}") from None
                results.append(result)
                print(
                    f"repeat {repeat} {result.runner:9s} step {result.step_s:.4f}s  first step "
                    f"{result.first_step_s:.1f}s  exit {result.exit_s:.1f}s  loss {result.final_loss:.4f}",
                    flush=True,
                )
    rows, ratio = table(args, results)
    print("\n" + "\n".join(rows))
    pairs = paired_ratios(results)
    print(
        f"\nratio distrain/torchrun (step time): {ratio:.3f} (goal ≤ {GOAL}); per repeat: "
        + ", ".join(f"{r:.3f}" for r in pairs)
    )
    if args.out:
        out = ROOT / args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(markdown(args, info, results, command))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
