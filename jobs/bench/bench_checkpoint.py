"""Training time lost per checkpoint, in the foreground and in the background:  python jobs/bench/bench_checkpoint.py

Trains the same job three ways through distrain's own driver on one embedded Ray cluster: without
checkpoints (`checkpoint.interval=0`), with a checkpoint every --interval steps written in the foreground
(`checkpoint.async=false`: the step waits for the whole write and the commit) and in the background
(`checkpoint.async=true`, the default: the step waits only while the state is copied into host memory),
alternating the order over the repeats. Two measures per run, from its metrics.jsonl:

- the time the step waits per save: `checkpoint_block_s`, which the trainer logs with the step after each
  save (the save's barrier, the wait for the previous save, the staging copy; in the foreground the write
  and the commit too);
- the training time lost per checkpoint: the mean wall-clock time per step over the steps after the
  warm-up (between the step records, so a checkpoint's stall and a background write's competition for the
  cores or the memory bus both count), minus the same repeat's without checkpoints, times the steps
  measured, over the checkpoints among them.

The goals, at a checkpoint every 50 steps: in the background ≤ 5% of the step time between two
checkpoints, and the step blocked ≤ 1 s per save (torchtitan reports 0.78 s for a 70B model with async DCP).

On CPU workers (the default without a GPU, or --device cpu): `model=nano` on --workers DDP workers, gloo,
fp32. On a GPU (the default where CUDA is available, or --device gpu): `model=llama_1b` on one GPU as
jobs/bench/bench_mfu.py trains it (FSDP at world size 1, bf16, compiled blocks, 16 × 2048 tokens per step),
each checkpoint ~12 GB (weights and AdamW state in fp32). Writes docs/checkpoint.md (CPU) or
docs/checkpoint-gpu.md (GPU).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
from pathlib import Path

import bench_mfu  # its first import is harness, which keeps Ray on loopback
import harness

GOAL = 0.05  # time lost per checkpoint in the background ÷ (interval × step time)
BLOCK_GOAL_S = 1.0  # the step's wait per background save
VARIANTS = {
    "none": ["checkpoint.interval=0"],
    "sync": ["checkpoint.async=false"],
    "async": ["checkpoint.async=true"],
}
HEAD = ["checkpoints", "step time (s)", "step blocked per save (s)", "lost per checkpoint (s)"]
HEAD += ["% of the steps between two", "final losses"]
LABELS = {"none": "no checkpoints", "sync": "foreground (`async=false`)", "async": "background (`async=true`)"}
# One GPU as jobs/bench/bench_mfu.py trains on it, compiled; the model and the step count come from the options.
GPU_RUN = [*bench_mfu.ONE_GPU, "cluster.use_gpu=true", "strategy.compile=true", "logger.wandb.mode=disabled"]
GPU_RUN += ["logger.progress_interval_s=600"]
GPU_BATCH = [f"trainer.{key}={value}" for key, value in bench_mfu.BATCH.items()]
# Each device's defaults; a GPU's page beside the CPU's, which keeps its figures.
DEFAULTS = {
    "cpu": {"model": "nano", "steps": 210, "repeats": 3, "out": "docs/checkpoint.md"},
    "gpu": {"model": "llama_1b", "steps": 160, "repeats": 1, "out": "docs/checkpoint-gpu.md"},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.parser(__doc__, "docs/checkpoint.md", repeats=3, cluster=True)
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto", help="auto: gpu where CUDA is")
    p.add_argument("--model", default=None, help="a conf/model/*.yaml name (default nano, GPU llama_1b)")
    p.add_argument("--workers", type=int, default=2, help="CPU workers (default 2; a GPU run has one)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 210, GPU 160)")
    p.add_argument("--interval", type=int, default=50, help="steps between checkpoints (default 50)")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out (default 5)")
    known, _ = p.parse_known_args(argv)
    if known.device == "auto":
        import torch

        known.device = "gpu" if torch.cuda.is_available() else "cpu"
    defaults = DEFAULTS[known.device]
    p.set_defaults(default_repeats=defaults["repeats"], out=defaults["out"])
    args = harness.parse(p, argv)
    args.device, args.model = known.device, args.model or defaults["model"]
    args.steps = args.steps or defaults["steps"]
    if args.smoke:
        args.model, args.steps, args.interval, args.warmup = "nano", 12, 4, 1
    if args.steps < args.warmup + 2 * args.interval:
        p.error(f"--steps={args.steps} must cover --warmup and two --interval's checkpoints")
    return args


def overrides(args: argparse.Namespace) -> list[str]:
    """What every run shares, on CPU workers or on one GPU."""
    size = harness.TINY if args.smoke else []
    if args.device == "gpu":
        return [f"model={args.model}", *GPU_RUN, *(size or GPU_BATCH)]
    return [f"model={args.model}", f"cluster.num_workers={args.workers}", *harness.CPU_RUN, *size]


def run(variant: str, repeat: int, args: argparse.Namespace, storage: Path) -> dict:
    """One run: mean seconds per step over steps warmup+1 .. steps-1 (the last one also validates and
    writes the final checkpoint), the checkpoints among them, the median of the steps' waits per save,
    and one checkpoint's bytes on disk."""
    name = f"{variant}-{repeat}"
    trained = harness.train(
        [
            f"trainer.max_steps={args.steps}",
            f"checkpoint.interval={args.interval}",
            *VARIANTS[variant],
            "trainer.eval_interval=0",
            "trainer.eval_batches=1",
            "cluster.reuse_workers=true",
            f"run.storage={storage}",
            f"run.name={name}",
            *overrides(args),
        ]
    )
    if trained.error:
        raise SystemExit(f"bench_checkpoint: {variant}: {trained.error}")
    at = {m["step"]: m["time"] for m in trained.metrics}
    first, last = args.warmup, args.steps - 1
    saved = sorted((storage / name / "checkpoints").glob("step_*"))[-1]
    # The periodic saves' waits: the final save's is never logged (no step follows it).
    blocked = [m["checkpoint_block_s"] for m in trained.metrics if "checkpoint_block_s" in m]
    result = {
        "step_s": (at[last] - at[first]) / (last - first),
        "checkpoints": 0 if variant == "none" else sum(1 for s in range(first + 1, last + 1) if s % args.interval == 0),
        "blocked_s": statistics.median(blocked) if blocked else None,
        "bytes": sum(f.stat().st_size for f in saved.iterdir()),
        "loss": trained.summary["final_loss"],
    }
    if args.device == "gpu":
        shutil.rmtree(storage / name / "checkpoints")  # ~12 GB each for the 1B model
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


def body(args: argparse.Namespace, trials: list[harness.Trial]) -> str:
    runs = harness.by_key(trials)
    base = statistics.median(t.result["step_s"] for t in runs["none"])
    lost = lost_per_checkpoint(trials, args)
    blocked = {v: [t.result["blocked_s"] for t in runs[v] if t.result["blocked_s"] is not None] for v in lost}
    size = statistics.median(t.result["bytes"] for t in runs["async"])
    rows = []
    for v in VARIANTS:
        step = [t.result["step_s"] for t in runs[v]]
        cost = [x / (args.interval * base) for x in lost[v]] if v in lost else []
        rows.append(
            [
                LABELS[v],
                harness.spread(step, ".4f"),
                harness.spread(blocked[v], ".3f") if blocked.get(v) else "—",
                harness.spread(lost[v], ".3f") if v in lost else "—",
                harness.spread([100 * c for c in cost], ".1f") if cost else "—",
                " ".join(f"{t.result['loss']:.4f}" for t in runs[v]),
            ]
        )
    share = statistics.median(lost["async"]) / (args.interval * base)
    verdict = "within" if share <= GOAL else "outside"
    saved = statistics.median(lost["sync"]) - statistics.median(lost["async"])
    wait, wait_sync = (statistics.median(blocked[v]) for v in ("async", "sync"))
    if args.device == "gpu":
        where = (
            f"model `{args.model}` on one GPU as jobs/bench/bench_mfu.py trains it (FSDP at world size 1, bf16, "
            "compiled blocks"
            + (")" if args.smoke else ", 16 × 2048 tokens per step)")
            + ", the checkpoint's state staged in pinned host memory"
        )
    else:
        where = f"model `{args.model}`, {args.workers} DDP workers, CPU (gloo)"
    return "\n".join(
        [
            f"- Settings: {where}, {args.steps} steps, a checkpoint every {args.interval} steps ({size / 2**20:,.1f} "
            "MiB on disk: weights, AdamW state, per-rank RNG), storage on the local disk; "
            f"{args.repeats} repeat(s), the three runs' order alternating.",
            "- Step blocked per save: the median over the run's saves of `checkpoint_block_s` in metrics.jsonl "
            "(the time the loop waits for the save; the trainer's `step_time_s` leaves it out). The first "
            "background save also allocates the host buffers the later ones reuse: the median leaves it out "
            "from three saves on.",
            f"- Step time: mean wall-clock seconds per step over steps {args.warmup + 1}–{args.steps - 1}, from the "
            "times of the step records in metrics.jsonl. Lost per checkpoint: (step time − the same repeat's step "
            "time without checkpoints) × steps measured ÷ checkpoints among them. Cells: median (min–max) over "
            "the repeats.",
            "",
            *harness.table(HEAD, rows),
            "",
            f"In the background the step waits {wait:.3f} s per save ("
            f"{'within' if wait <= BLOCK_GOAL_S else 'outside'} the goal of ≤ {BLOCK_GOAL_S:.0f} s; torchtitan "
            f"reports 0.78 s for a 70B model with async DCP), against {wait_sync:.3f} s in the foreground. In all, "
            f"a background checkpoint costs {statistics.median(lost['async']):.3f} s of training, "
            f"{share:.1%} of the {args.interval} steps between two, {verdict} the goal of ≤ {GOAL:.0%}; in the "
            f"foreground {statistics.median(lost['sync']):.3f} s, so the background saves {saved:.3f} s per "
            "checkpoint. What is left in the background is the copy of the state into host memory (the step "
            "waits for it), and the writing thread's share of the cores while the next steps run. The final "
            "losses are the same in all three: the checkpoints change nothing of the training.",
            *([] if args.device == "gpu" else gpu_section()),
        ]
    )


def gpu_section() -> list[str]:
    """The CPU page's pointer to the GPU's figures, or to the command that takes them."""
    taken = (harness.ROOT / DEFAULTS["gpu"]["out"]).exists()
    return [
        "",
        "## GPU",
        "",
        "`python jobs/bench/bench_checkpoint.py` on a machine with a GPU (or `--device gpu`) measures the same on "
        "`model=llama_1b` on one GPU as jobs/bench/bench_mfu.py trains it (FSDP at world size 1, bf16, compiled "
        "blocks), a checkpoint every 50 steps, and writes "
        + (
            "[checkpoint-gpu.md](checkpoint-gpu.md)."
            if taken
            else "docs/checkpoint-gpu.md. Its figures are still to be taken: no GPU has run it yet."
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    title = "Checkpoints: time lost, foreground vs background" + (" (one GPU)" if args.device == "gpu" else "")
    page = harness.Page(title, args)
    with harness.storage(args) as storage, harness.ray_cluster(args.address):
        trials = harness.alternate(list(VARIANTS), args.repeats, lambda v, k: run(v, k, args, storage))
    text = body(args, trials)
    print(text)
    page.write(text, trials)


if __name__ == "__main__":
    main()
