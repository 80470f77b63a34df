"""Training time lost per checkpoint, written in the foreground and in the background:  python jobs/bench_checkpoint.py

Trains the same job three ways through distrain's own driver on one embedded Ray cluster: without
checkpoints (`checkpoint.interval=0`), with a checkpoint every --interval steps written in the foreground
(`checkpoint.async=false`: the step waits for the whole write and the commit) and in the background
(`checkpoint.async=true`, the default: the step waits only while the state is copied into host memory),
alternating the order over the repeats. From each run's metrics.jsonl it takes the mean wall-clock time per
step over the steps after the warm-up (the wall-clock time between the step records, so a checkpoint's
stall and a background write's competition for the cores both count); the time lost per checkpoint is the
difference from the run without checkpoints, times the steps measured, over the checkpoints among them.
The goal: in the background, ≤ 5% of the step time at a checkpoint every 50 steps. Writes docs/checkpoint.md.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import harness  # first: it keeps Ray on loopback

GOAL = 0.05  # time lost per checkpoint in the background ÷ (interval × step time)
VARIANTS = {
    "none": ["checkpoint.interval=0"],
    "sync": ["checkpoint.async=false"],
    "async": ["checkpoint.async=true"],
}
HEAD = ["checkpoints", "step time (s)", "lost per checkpoint (s)", "% of the steps between two", "final losses"]
LABELS = {"none": "no checkpoints", "sync": "foreground (`async=false`)", "async": "background (`async=true`)"}


def parse_args(argv: list[str] | None = None):
    p = harness.parser(__doc__, "docs/checkpoint.md", repeats=3)
    p.add_argument("--model", default="nano", help="a conf/model/*.yaml name (default nano)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=210, help="steps per run (default 210)")
    p.add_argument("--interval", type=int, default=50, help="steps between checkpoints (default 50)")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out (default 5)")
    args = harness.parse(p, argv)
    if args.smoke:
        args.steps, args.interval, args.warmup = 12, 4, 1
    if args.steps < args.warmup + 2 * args.interval:
        p.error(f"--steps={args.steps} must cover --warmup and two --interval's checkpoints")
    return args


def run(variant: str, repeat: int, args, storage: Path) -> dict:
    """One run: mean seconds per step over steps warmup+1 .. steps-1 (the last one also validates and
    writes the final checkpoint), the checkpoints among them, and one checkpoint's bytes on disk."""
    name = f"{variant}-{repeat}"
    trained = harness.train(
        [
            f"model={args.model}",
            f"cluster.num_workers={args.workers}",
            f"trainer.max_steps={args.steps}",
            f"checkpoint.interval={args.interval}",
            *VARIANTS[variant],
            "trainer.eval_interval=0",
            "trainer.eval_batches=1",
            "cluster.reuse_workers=true",
            f"run.storage={storage}",
            f"run.name={name}",
            *(harness.TINY if args.smoke else []),
            *harness.CPU_RUN,
        ]
    )
    if trained.error:
        raise SystemExit(f"bench_checkpoint: {variant}: {trained.error}")
    at = {m["step"]: m["time"] for m in trained.metrics}
    first, last = args.warmup, args.steps - 1
    saved = sorted((storage / name / "checkpoints").glob("step_*"))[-1]
    result = {
        "step_s": (at[last] - at[first]) / (last - first),
        "checkpoints": 0 if variant == "none" else sum(1 for s in range(first + 1, last + 1) if s % args.interval == 0),
        "bytes": sum(f.stat().st_size for f in saved.iterdir()),
        "loss": trained.summary["final_loss"],
    }
    print(f"  {result['step_s']:.4f} s/step, {result['checkpoints']} checkpoints measured", flush=True)
    return result


def lost_per_checkpoint(trials: list[harness.Trial], args) -> dict[str, list[float]]:
    """variant → seconds lost per checkpoint in each repeat, against that repeat's run without them."""
    by = {(t.key, t.repeat): t.result for t in trials}
    steps = args.steps - 1 - args.warmup
    return {
        v: [
            (by[v, k]["step_s"] - by["none", k]["step_s"]) * steps / by[v, k]["checkpoints"]
            for k in range(1, args.repeats + 1)
        ]
        for v in ("sync", "async")
    }


def body(args, trials: list[harness.Trial]) -> str:
    runs = harness.by_key(trials)
    base = statistics.median(t.result["step_s"] for t in runs["none"])
    lost = lost_per_checkpoint(trials, args)
    size = statistics.median(t.result["bytes"] for t in runs["async"])
    rows = []
    for v in VARIANTS:
        step = [t.result["step_s"] for t in runs[v]]
        cost = [x / (args.interval * base) for x in lost[v]] if v in lost else []
        rows.append(
            [
                LABELS[v],
                harness.spread(step, ".4f"),
                harness.spread(lost[v], ".3f") if v in lost else "—",
                harness.spread([100 * c for c in cost], ".1f") if cost else "—",
                " ".join(f"{t.result['loss']:.4f}" for t in runs[v]),
            ]
        )
    share = statistics.median(lost["async"]) / (args.interval * base)
    verdict = "within" if share <= GOAL else "outside"
    saved = statistics.median(lost["sync"]) - statistics.median(lost["async"])
    return "\n".join(
        [
            f"- Settings: model `{args.model}`, {args.workers} DDP workers, {args.steps} steps, a checkpoint every "
            f"{args.interval} steps ({size / 2**20:.1f} MiB on disk: weights, AdamW state, per-rank RNG), CPU "
            f"(gloo), storage on the local disk; {args.repeats} repeat(s), the three runs' order alternating.",
            f"- Step time: mean wall-clock seconds per step over steps {args.warmup + 1}–{args.steps - 1}, from the "
            "times of the step records in metrics.jsonl. Lost per checkpoint: (step time − the same repeat's step "
            "time without checkpoints) × steps measured ÷ checkpoints among them. Cells: median (min–max) over "
            "the repeats.",
            "",
            *harness.table(HEAD, rows),
            "",
            f"In the background a checkpoint costs {statistics.median(lost['async']):.3f} s of training, "
            f"{share:.1%} of the {args.interval} steps between two, {verdict} the goal of ≤ {GOAL:.0%}; in the "
            f"foreground {statistics.median(lost['sync']):.3f} s, so the background saves {saved:.3f} s per "
            "checkpoint. What is left in the background is the copy of the state into host memory (the step "
            "waits for it), and the writing thread's share of the cores while the next steps run. The final "
            "losses are the same in all three: the checkpoints change nothing of the training.",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    page = harness.Page("Checkpoints: time lost, foreground vs background", args)
    with harness.storage(args) as storage, harness.ray_cluster():
        trials = harness.alternate(list(VARIANTS), args.repeats, lambda v, k: run(v, k, args, storage))
    text = body(args, trials)
    print(text)
    page.write(text, trials)


if __name__ == "__main__":
    main()
