"""Tokens/s and MFU of the ~1B model on one GPU, eager beside compiled:  python jobs/bench_mfu.py

Trains `model=llama_1b` with FSDP at world size 1 (`strategy=zero3 cluster.num_workers=1`) in bf16
through distrain's own driver (`distrain.launch.train`), with `strategy.compile=false` and with
`strategy.compile=true`, alternating which goes first over the repeats, then reads each run's
metrics.jsonl: the median over the steps after --warmup of tokens/s, MFU and step time. The goal is ≥ 50%
MFU on an H100. Writes docs/mfu.md and, with --json, each run's numbers. Needs a GPU: without one it says
so and exits 0, writing no page (MFU is only defined against a GPU's bf16 peak).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import harness  # first: it keeps Ray on loopback

GOAL = 0.50  # MFU on an H100
VARIANTS = {"eager": "strategy.compile=false", "compiled": "strategy.compile=true"}


@dataclass
class Result:
    tokens_per_s: float  # medians over the steps after the warm-up
    step_time_s: float
    mfu: float | None  # None: the device's bf16 peak is unknown and --peak-tflops was not given
    peak_memory_gib: float
    first_step_s: float  # launch.train → first completed step: Ray, placement, model build, compilation
    final_loss: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.parser(__doc__, "docs/mfu.md", repeats=1)
    p.add_argument("--model", default="llama_1b", help="a conf/model/*.yaml name (default llama_1b)")
    p.add_argument("--steps", type=int, default=30, help="training steps per run (default 30)")
    p.add_argument("--warmup", type=int, default=10, help="first steps left out: compilation, allocator (default 10)")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step (default 16)")
    # 8, not 4: on an H100 micro-batch 4 gave 49.6% MFU compiled, 8 gave 54.0%.
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward (default 8)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"a subset of {','.join(VARIANTS)}")
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, if distrain lacks it")
    p.add_argument("--json", default=None, metavar="PATH", help="also write each run's numbers as JSON")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = harness.parse(p, argv)
    if args.smoke:
        args.model, args.steps, args.warmup, args.seq_len = "nano", 4, 1, 256
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown or not args.variants:
        p.error(f"--variants: unknown {', '.join(unknown) or '(none given)'}; choose from {','.join(VARIANTS)}")
    if args.steps < args.warmup + 3:
        p.error(f"--steps={args.steps} leaves fewer than 3 steps after --warmup={args.warmup}")
    return args


def overrides(args: argparse.Namespace, variant: str, storage: Path, name: str) -> list[str]:
    """The Hydra overrides of one run: `python jobs/train.py <these>` trains the same thing."""
    return [
        f"model={args.model}",
        "strategy=zero3",
        "cluster.num_workers=1",
        "trainer.precision=bf16",
        VARIANTS[variant],
        f"trainer.max_steps={args.steps}",
        f"trainer.global_batch_size={args.global_batch}",
        f"trainer.micro_batch_size={args.micro_batch}",
        f"trainer.seq_len={args.seq_len}",
        "trainer.eval_interval=0",  # only the final validation, after the last measured step
        "trainer.eval_batches=1",
        "checkpoint.interval=0",  # only the final checkpoint, after the last measured step
        "logger.wandb.mode=disabled",
        f"run.storage={storage}",
        f"run.name={name}",
        *args.overrides,
    ]


def run(variant: str, repeat: int, args: argparse.Namespace, storage: Path, peak: float | None) -> Result | str:
    """One run's medians over the steps after the warm-up of what the trainer logged (its step_time_s
    leaves out validation and checkpointing); MFU the trainer's where it knows the device's peak, else
    computed from `peak` with the same formula. What went wrong instead, if it failed (an OOM, compile
    unsupported): the other runs still go on."""
    trained = harness.train(overrides(args, variant, storage, f"mfu-{variant}-{repeat}"))
    shutil.rmtree(Path(trained.cfg.run_dir, "checkpoints"), ignore_errors=True)  # ~12 GB each for the 1B model
    records = [r for r in trained.metrics if r["step"] > args.warmup]
    if trained.error or not records:
        print(f"bench_mfu: {variant} failed: {trained.error or 'no steps after the warm-up'}", file=sys.stderr)
        return trained.error or "no steps after the warm-up"
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in records)
    mfu = statistics.median(r["mfu"] for r in records) if all("mfu" in r for r in records) else None
    if mfu is None and peak:
        mfu = trained.summary["flops_per_token"] * tokens_per_s / peak  # world size 1
    result = Result(
        tokens_per_s,
        statistics.median(r["step_time_s"] for r in records),
        mfu,
        max(r["peak_memory_bytes"] for r in records) / 2**30,
        trained.summary["first_step_s"],
        records[-1]["loss"],
    )
    print(f"bench_mfu: {variant}: {tokens_per_s:,.0f} tokens/s, MFU {mfu or 0:.1%}, step {result.step_time_s:.3f}s")
    return result


def table(trials: list[harness.Trial]) -> list[str]:
    rows = []
    for t in sorted(trials, key=lambda t: (t.key, t.repeat)):
        r, label = t.result, f"{t.key} (`{VARIANTS[t.key]}`)"
        if isinstance(r, str):
            rows.append([label, t.repeat, f"failed: {r.replace('|', '/')}", "", "", "", "", "", f"{t.load:.2f}"])
            continue
        mfu = f"{r.mfu:.1%}" if r.mfu is not None else "— (peak unknown)"
        rows.append(
            [label, t.repeat, f"{r.tokens_per_s:,.0f}", mfu, f"{r.step_time_s:.3f}", f"{r.peak_memory_gib:.1f}"]
            + [f"{r.first_step_s:.1f}", f"{r.final_loss:.4f}", f"{t.load:.2f}"]
        )
    head = ["run", "repeat", "tokens/s", "MFU", "step time (s)", "peak memory (GiB)", "launch → first step (s)"]
    return harness.table([*head, "loss at last step", "load"], rows)


def body(args: argparse.Namespace, trials: list[harness.Trial]) -> str:
    from distrain.cli import compose
    from distrain.model.size import flops_per_token, num_params

    cfg = compose(overrides(args, args.variants[0], Path("/tmp"), "plan"))
    fpt, h100 = flops_per_token(cfg.model, args.seq_len), 989e12
    lines = [
        f"`model={args.model}` ({num_params(cfg.model) / 1e9:.2f} B parameters) on one GPU with FSDP at world size 1",
        "(`strategy=zero3 cluster.num_workers=1`) in bf16 autocast, through distrain's own driver",
        "(`distrain.launch.train`, Ray worker included), eager (`strategy.compile=false`) and with each block",
        "compiled (`strategy.compile=true`): tokens/s and model FLOPs utilisation side by side. The goal is",
        f"≥ {GOAL:.0%} MFU on an H100.",
        "",
        f"- Settings: global batch {args.global_batch} × {args.seq_len} tokens "
        f"({args.global_batch * args.seq_len:,} tokens per step), micro-batch {args.micro_batch} "
        f"({args.global_batch // args.micro_batch} micro-batch(es) per step), AdamW, {args.steps} steps per run, "
        f"{args.repeats} run(s) of each, alternating which goes first; `checkpoint.interval=0 "
        "trainer.eval_interval=0 logger.wandb.mode=disabled`"
        + (f", plus `{' '.join(args.overrides)}`" if args.overrides else "")
        + ".",
        f"- Each number is the median over steps {args.warmup + 1}–{args.steps} of what the trainer logs in",
        "  `metrics.jsonl` (`tokens_per_s`, `mfu`, `step_time_s`); the first steps (compilation, the",
        "  allocator's growth) are left out. The trainer's step time leaves out validation and checkpoint",
        "  saving. Launch → first step is summary.json's `first_step_s`: Ray's start, placement, model build,",
        "  and with compile the compilation of the first step.",
        "- MFU = flops_per_token × tokens/s ÷ (peak bf16 FLOP/s × world size). `flops_per_token`",
        "  (`distrain/model/size.py`) counts training FLOPs, forward and backward, as PaLM does: 6 per weight",
        "  that multiplies the token plus the attention scores and their weighted sum, `12 · L · H · Q · T`;",
        f"  activation recomputation is not counted. For `{args.model}` at seq_len {args.seq_len}: "
        f"{fpt / 1e9:.2f} GFLOP per token.",
        "- The peak is the dense bf16 tensor-core figure of the device (`distrain/train/metrics.py`);",
        f"  `--peak-tflops` gives it for another GPU. {GOAL:.0%} MFU on an H100 SXM (989 TFLOP/s) is "
        f"{GOAL * h100 / fpt:,.0f} tokens/s here.",
        "",
        *table(trials),
        "",
    ]
    done = {v: [t.result for t in ts if not isinstance(t.result, str)] for v, ts in harness.by_key(trials).items()}
    if done.get("eager") and done.get("compiled"):
        speed = statistics.median(r.tokens_per_s for r in done["compiled"]) / statistics.median(
            r.tokens_per_s for r in done["eager"]
        )
        lines.append(f"Compiling the blocks gives {speed:.2f}× the eager throughput (medians over the runs).")
    best = max((r for rs in done.values() for r in rs if r.mfu is not None), key=lambda r: r.mfu, default=None)
    if best is not None:
        verdict = "meets" if best.mfu >= GOAL else "falls short of"
        lines.append(f"The best run ({best.mfu:.1%} MFU) {verdict} the goal of ≥ {GOAL:.0%}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(
            "bench_mfu: needs a GPU (torch.cuda.is_available() is False): MFU is measured against a GPU's bf16 "
            "peak, so nothing was measured and no page written. Run it on a GPU machine."
        )
        return
    from distrain.train.metrics import peak_flops

    known = peak_flops(torch.device("cuda", 0), "bf16")
    peak = args.peak_tflops * 1e12 if args.peak_tflops else known
    if peak is None:
        print(f"bench_mfu: no bf16 peak known for {torch.cuda.get_device_name(0)}: MFU is left out (--peak-tflops)")
    page = harness.Page("MFU: the ~1B model on one GPU", args)
    with harness.storage(args) as storage, harness.ray_cluster():
        trials = harness.alternate(args.variants, args.repeats, lambda v, k: run(v, k, args, storage, peak))
    print("\n".join(table(trials)))
    page.write(body(args, trials), trials)
    if args.json:
        runs = [
            {"variant": t.key, "repeat": t.repeat}
            | (asdict(t.result) if isinstance(t.result, Result) else {"error": t.result})
            for t in trials
        ]
        raw = {"command": args.command, "device": torch.cuda.get_device_name(0), "goal": GOAL, "runs": runs}
        Path(args.json).write_text(json.dumps(raw, indent=1) + "\n")
        print(f"bench_mfu: wrote {args.json}")
    if any(isinstance(t.result, str) for t in trials):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
