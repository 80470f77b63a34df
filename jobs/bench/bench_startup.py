"""Launch → first step, phase by phase: distrain embedded, attached, torchrun:  python jobs/bench/bench_startup.py

Each run is a command on this machine, the job of jobs/bench/bench_ddp.py cut to a few steps (nano, 2 workers,
no W&B, no checkpoint, no evaluation): `jobs/train.py` starting an embedded Ray cluster; `jobs/train.py`
attached (`cluster.address=`) to a cluster that `ray start --head` started on 127.0.0.1 before the first
run and that stays up until the last; `torchrun --standalone jobs/bench/ddp_torchrun.py`. With `--baseline DIR`
(a checkout of an earlier commit, e.g. `git worktree add /tmp/before <commit>`), its distrain runs go
beside this checkout's, from its own directory. Every configuration runs --repeats times, the order
reversed on every other repeat. Launch → first step is from starting the command to the first step's
record; distrain's phases come from the marks its runs write to summary.json (`startup`: the driver;
the attempt's `timings`: the supervisor, and rank 0's reports). Writes docs/startup.md.
"""

from __future__ import annotations

import json
import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import bench_ddp
import harness  # first: it keeps Ray on loopback

from distrain.testing import processes

GOALS_S = {"embedded": 3.0, "attached": 1.0}  # the most each may take beyond torchrun, launch → first step
MODES = {
    "embedded": "distrain, embedded cluster",
    "attached": "distrain, attached to a running cluster",
    "torchrun": "torchrun --standalone",
}
# Each phase ends at a mark (the first of launch, the last of the first step's record); a run without a
# mark (an earlier commit's) counts that phase in the next one it has.
PHASES = [
    ("imported_at", "Python start, jobs/train.py's imports"),
    ("composed_at", "Hydra compose"),
    ("started_at", "driver imports (Ray, distrain)"),
    ("connected_at", "Ray start (embedded) or attach"),
    ("reserved_at", "supervisor, placement group"),
    ("placed_at", "actor processes started"),
    ("launched_at", "driver prepares the attempt"),
    ("running_at", "worker imports (torch, trainer)"),
    ("joined_at", "rendezvous (process group)"),
    ("loaded_at", "model build, data, optimizer"),
    ("first_step", "first step"),
]
BASELINE = " (baseline)"


@dataclass
class Result:
    first_step_s: float  # command launch → the first step's record
    phases: dict[str, float | None] = field(default_factory=dict)  # end mark → seconds; None: counted in the next
    placed_s: float | None = None  # launch → the actors started: the driver's and Ray's part, before the workers'


def parse_args(argv: list[str] | None = None):
    p = harness.parser(__doc__, "docs/startup.md", repeats=3)
    bench_ddp.add_job_options(p, steps=3)
    p.add_argument("--baseline", default="", help="a checkout of an earlier commit, measured beside this one")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    args = harness.parse(p, argv)
    if args.smoke:
        args.steps, args.global_batch, args.micro_batch, args.seq_len = 2, 8, 2, 32
    if args.baseline and not (Path(args.baseline) / "jobs" / "train.py").exists():
        p.error(f"--baseline={args.baseline} is not a checkout of this repository")
    return args


def describe_checkout(path: Path) -> str:
    out = subprocess.run(["git", "-C", str(path), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def command(key: str, args, storage: Path, name: str, head: str) -> tuple[list[str], dict[str, str]]:
    """A run's command line and what it adds to the environment: bench_ddp's, attached to `head`, and run
    from its checkout (this one, or the baseline) with that checkout's distrain first on the path of the
    driver and its workers (an editable install would name one checkout for all)."""
    mode, tree = key.removesuffix(BASELINE), args.baseline if key.endswith(BASELINE) else str(harness.ROOT)
    cmd, env = bench_ddp.command("torchrun" if mode == "torchrun" else "distrain", args, storage, name)
    if mode == "attached":
        cmd.append(f"cluster.address={head}")
        env.update(harness.AUTH)
    return ["env", "-C", tree, *cmd], {**env, "PYTHONPATH": tree}


def run(key: str, repeat: int, args, storage: Path, head: str) -> Result:
    name = f"{key.replace(BASELINE, '-baseline')}-{repeat}"
    cmd, env = command(key, args, storage, name, head)
    try:
        done = processes.run_command(cmd, storage / f"{name}.log", args.timeout, env)
    except processes.CommandTimeout as e:
        raise SystemExit(f"{harness.PROG}: {e}") from None
    if done.rc != 0:
        raise SystemExit(f"{harness.PROG}: {key} (repeat {repeat}) exited with {done.rc}:\n{done.tail()}")
    if key == "torchrun":
        first = next(json.loads(line) for line in done.log.read_text().splitlines() if line.startswith('{"step"'))
        result = Result(first["time"] - done.started)
    else:
        result = distrain_result(storage / name, done.started)
    print(f"  launch → first step {result.first_step_s:.2f} s", flush=True)
    return result


def distrain_result(run_dir: Path, launched: float) -> Result:
    """Launch → first step, and each phase: from the previous mark the run wrote to the phase's own."""
    summary = json.loads((run_dir / "summary.json").read_text())
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    marks = {**summary.get("startup", {}), **summary["attempts"][0]["timings"], "first_step": first["time"]}
    phases, previous = {}, launched
    for mark, _ in PHASES:
        phases[mark] = marks[mark] - previous if mark in marks else None
        previous = marks.get(mark, previous)
    return Result(first["time"] - launched, phases, marks["placed_at"] - launched)


# -- the page ----------------------------------------------------------------------------------------


def beyond_torchrun(trials: list[harness.Trial], key: str) -> list[float]:
    """Each of `key`'s runs less torchrun's of the same repeat (they ran close together, under the same load)."""
    torchrun = {t.repeat: t.result.first_step_s for t in trials if t.key == "torchrun"}
    return [t.result.first_step_s - torchrun[t.repeat] for t in trials if t.key == key]


def goal(key: str, over: list[float]) -> str:
    limit = GOALS_S.get(key.removesuffix(BASELINE))
    return "" if limit is None else f"≤ {limit:g} s: {'met' if statistics.median(over) <= limit else 'not met'}"


def totals_table(trials: list[harness.Trial]) -> list[str]:
    """Each configuration's launch → first step, and what it takes beyond torchrun's run of the same repeat."""
    rows = []
    for key, mine in harness.by_key(trials).items():
        over = beyond_torchrun(trials, key)
        extra = "" if key == "torchrun" else harness.spread(over)
        rows.append([label(key), harness.spread([t.result.first_step_s for t in mine]), extra, goal(key, over)])
    return harness.table(["configuration", "launch → first step (s)", "beyond torchrun (s)", "goal"], rows, "lrrl")


def reading(trials: list[harness.Trial]) -> str:
    """Where each distrain configuration stands against torchrun and the goal, split where its workers take
    over; and against the baseline, the phase cut most."""
    runs = harness.by_key(trials)
    torchrun = median_first(runs.pop("torchrun"))
    lines = []
    for key, mine in runs.items():
        over = statistics.median(beyond_torchrun(trials, key))
        placed = statistics.median(t.result.placed_s for t in mine)
        workers = statistics.median(t.result.first_step_s - t.result.placed_s for t in mine)
        lines.append(
            f"- {label(key)}: {median_first(mine):.1f} s, {over:+.1f} s beyond torchrun ({goal(key, [over])}). "
            f"{placed:.1f} s until its worker actors run (the driver, Ray, placement), then {workers:.1f} s in "
            f"the workers (imports, rendezvous, model, data, first step), where torchrun takes {torchrun:.1f} s "
            "for all of its work."
        )
    for mode in GOALS_S:
        if f"{mode}{BASELINE}" in runs:
            before, after = runs[f"{mode}{BASELINE}"], runs[mode]
            change = {
                name: statistics.median(t.result.phases[mark] for t in after)
                - statistics.median(t.result.phases[mark] for t in before)
                for mark, name in PHASES
                if all(t.result.phases[mark] is not None for t in [*before, *after])
            }
            most = min(change, key=change.get)
            lines.append(
                f"- {MODES[mode]}, against the baseline: launch → first step {median_first(before):.1f} → "
                f"{median_first(after):.1f} s; the phase cut most: {most} ({change[most]:+.2f} s)."
            )
    return "\n".join(lines)


def phases_table(trials: list[harness.Trial]) -> list[str]:
    """Distrain's phases, the median of each over its repeats, one column per configuration."""
    runs = {k: v for k, v in harness.by_key(trials).items() if k != "torchrun"}
    rows = []
    for mark, name in PHASES:
        cells = []
        for mine in runs.values():
            values = [t.result.phases[mark] for t in mine]
            cells.append("↓" if None in values else f"{statistics.median(values):.2f}")
        rows.append([name, *cells])
    rows.append(["**launch → first step**", *(f"**{median_first(mine):.2f}**" for mine in runs.values())])
    return harness.table(["phase (s)", *map(label, runs)], rows)


def median_first(mine: list[harness.Trial]) -> float:
    return statistics.median(t.result.first_step_s for t in mine)


def runs_table(trials: list[harness.Trial]) -> list[str]:
    rows = [
        [t.repeat, t.position, label(t.key), f"{t.load:.2f}", f"{t.result.first_step_s:.2f}"]
        for t in sorted(trials, key=lambda t: (t.repeat, t.position))
    ]
    return harness.table(["repeat", "order", "configuration", "load before", "launch → first step (s)"], rows, "rrlrr")


def label(key: str) -> str:
    mode = key.removesuffix(BASELINE)
    return MODES[mode] + (BASELINE if key.endswith(BASELINE) else "")


def body(args, trials: list[harness.Trial], baseline: str) -> str:
    return "\n".join(
        [
            "How long each runner takes from the command's launch to its first completed training step, and",
            "where distrain's time goes. torchrun starts the ranks' processes itself; distrain's driver starts",
            "(or attaches to) Ray, places a worker actor per rank, and the workers then do what torchrun's ranks",
            "do (import torch, rendezvous, build the model, load the data, step).",
            "",
            f"- Job: {bench_ddp.job_settings(args)}; distrain with "
            "`logger.wandb.mode=disabled checkpoint.interval=0 trainer.eval_interval=0`.",
            "- *Attached*: `cluster.address=` a head that `ray start --head --node-ip-address=127.0.0.1` started "
            "before the first run (token authentication; no dashboard), which ran one small job first and stays "
            "up for every run: each run is a new job on it, and its worker processes start with the job.",
            (
                f"- *Baseline*: the same runs from `{args.baseline}` (`{baseline}`), alternating with this checkout's."
                if baseline
                else "- No baseline measured (`--baseline`)."
            ),
            "- Launch → first step: from starting the command to the first step's record (distrain's metrics.jsonl, "
            f"torchrun's rank 0 line). Medians (min–max) over {args.repeats} run(s) of each configuration; "
            "*beyond torchrun* pairs each run with torchrun's of the same repeat.",
            "",
            *totals_table(trials),
            "",
            reading(trials),
            "",
            "## distrain's start, phase by phase",
            "",
            "Each phase ends at a mark the run records (summary.json: `startup`, then the first attempt's "
            "`timings`) and begins at the one before; the first begins at launch and the last ends at the "
            "first step's record. ↓: the run records no mark there (an earlier commit): that time is in the "
            "next phase it records. Medians over the repeats, so a column need not add up to its total.",
            "",
            *phases_table(trials),
            "",
            "- *Ray start*: `ray.init` starts the GCS, then Ray's API server (started, and waited for, even "
            "without the dashboard), then the raylet, which joins the cluster once its dashboard agent is up; "
            "then the driver connects. All of it is Ray's own start; attached, only the connection is left.",
            "- *supervisor, placement group*: from Ray being up to the workers' bundles reserved, with the "
            "driver's work before it (the supervisor; a driver that imports the trainer to hand the workers its "
            "functions imports torch here).",
            "- *driver prepares the attempt*: checkpoint lookup, the engine's functions.",
            "- *worker imports*: from the calls about to be sent (their round trips: rendezvous port, channel "
            "reset) to rank 0's call running, its function imported.",
            "",
            "## Every run",
            "",
            *runs_table(trials),
        ]
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    page = harness.Page("Start-up: launch → first step", args)
    baseline = describe_checkout(Path(args.baseline)) if args.baseline else ""
    keys = ["embedded", "attached", "torchrun"]
    keys += [f"{k}{BASELINE}" for k in keys[:2]] if baseline else []
    with harness.storage(args) as storage, harness.ray_head(storage) as head:
        trials = harness.alternate(keys, args.repeats, lambda key, k: run(key, k, args, storage, head), label)
    print("\n" + "\n".join(totals_table(trials)) + "\n\n" + "\n".join(phases_table(trials)))
    page.write(body(args, trials, baseline), trials)


if __name__ == "__main__":
    main()
