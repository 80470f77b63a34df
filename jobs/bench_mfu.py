"""Tokens/s and MFU of the ~1B model on one GPU, eager beside compiled:  python jobs/bench_mfu.py

Trains `model=llama_1b` with FSDP at world size 1 (`strategy=zero3 cluster.num_workers=1`) in bf16
through distrain's own driver (`distrain.launch.train` on a config composed from conf/ by Hydra), once
with `strategy.compile=false` and once with `strategy.compile=true`, each into its own run directory,
then reads each run's metrics.jsonl: the median over the steps after --warmup of tokens/s, MFU and step
time. The goal is ≥ 50% MFU on an H100. Writes the results to docs/mfu.md. On a machine without a GPU
it says so and exits 0 without starting Ray: MFU is only defined against a GPU's bf16 peak.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from machine import machine  # jobs/machine.py, beside this script

if TYPE_CHECKING:  # imported where used: without a GPU the benchmark loads neither Ray nor the trainer
    from distrain.config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
GOAL = 0.50  # MFU on an H100
VARIANTS = {"eager": "strategy.compile=false", "compiled": "strategy.compile=true"}


@dataclass
class Result:
    variant: str
    tokens_per_s: float  # medians over the steps after the warm-up
    step_time_s: float
    mfu: float | None  # None: the device's bf16 peak is unknown and --peak-tflops was not given
    peak_memory_gib: float
    first_step_s: float  # launch.train → first completed step: Ray, placement, model build, compilation
    final_loss: float
    steps_measured: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama_1b", help="a conf/model/*.yaml name (default llama_1b)")
    p.add_argument("--steps", type=int, default=30, help="training steps per run (default 30)")
    p.add_argument("--warmup", type=int, default=10, help="first steps left out: compilation, allocator (default 10)")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward (default 4)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated subset of {','.join(VARIANTS)}, run in that order (default: both)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the GPU's dense bf16 peak, for a GPU distrain has no figure for (MFU is then computed here)",
    )
    p.add_argument("--storage", default=None, help="where the runs go (default: a temporary directory, removed)")
    p.add_argument("--out", default="docs/mfu.md", help="markdown report, '' for none (default docs/mfu.md)")
    p.add_argument(
        "overrides", nargs="*", help="extra Hydra overrides for both runs, e.g. strategy.activation_checkpoint=true"
    )
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown or not args.variants:
        p.error(f"--variants: unknown {', '.join(unknown) or '(none given)'}; choose from {','.join(VARIANTS)}")
    if args.steps < args.warmup + 3:
        p.error(f"--steps={args.steps} leaves fewer than 3 steps after --warmup={args.warmup}")
    return args


def overrides(args: argparse.Namespace, variant: str, storage: Path) -> list[str]:
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
        f"run.name=mfu-{variant}",
        *args.overrides,
    ]


def compose(overrides: list[str]) -> TrainConfig:
    """The TrainConfig `python jobs/train.py <overrides>` would train, validated (no Ray, no GPU needed)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    import distrain.config  # noqa: F401  (registers the config schemas with Hydra)
    from distrain.cli import CONF_DIR, check_group_choices
    from distrain.config import ConfigError
    from distrain.validation import validate

    check_group_choices(overrides)  # `model=nope`: one line naming the choices, not Hydra's page
    try:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = OmegaConf.to_object(hydra_compose("train", overrides=overrides))
        validate(cfg)
    except (HydraException, OmegaConfBaseException, ConfigError) as e:
        raise SystemExit(f"bench_mfu: error: {str(e).strip().splitlines()[0]}") from None
    return cfg


def measure(variant: str, run_dir: Path, warmup: int, peak_flops: float | None) -> Result:
    """Medians over the steps after the warm-up of what the trainer logged (its step_time_s leaves
    out validation and checkpointing, so the final ones do not count). MFU is the trainer's where it
    knows the device's peak, else computed here from `peak_flops` with the same formula."""
    from distrain.tracking import read_metrics

    records = [r for r in read_metrics(str(run_dir)) if r["step"] > warmup]
    if not records:
        raise SystemExit(f"bench_mfu: {variant}: no steps after --warmup={warmup} in {run_dir}/metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in records)
    if all("mfu" in r for r in records):
        mfu = statistics.median(r["mfu"] for r in records)
    elif peak_flops:
        mfu = summary["flops_per_token"] * tokens_per_s / peak_flops  # world size 1
    else:
        mfu = None
    return Result(
        variant,
        tokens_per_s,
        statistics.median(r["step_time_s"] for r in records),
        mfu,
        max(r["peak_memory_bytes"] for r in records) / 2**30,
        summary["first_step_s"],
        records[-1]["loss"],
        len(records),
    )


def table(results: list[Result], failures: dict[str, str] | None = None) -> list[str]:
    rows = [
        "| run | tokens/s | MFU | step time (s) | peak memory (GiB) | launch → first step (s) | loss at last step |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        mfu = f"{r.mfu:.1%}" if r.mfu is not None else "— (peak unknown)"
        rows.append(
            f"| {r.variant} (`{VARIANTS[r.variant]}`) | {r.tokens_per_s:,.0f} | {mfu} | {r.step_time_s:.3f} "
            f"| {r.peak_memory_gib:.1f} | {r.first_step_s:.1f} | {r.final_loss:.4f} |"
        )
    for variant, why in (failures or {}).items():
        rows.append(f"| {variant} (`{VARIANTS[variant]}`) | failed: {why.replace('|', '/')} | | | | | |")
    return rows


def markdown(
    args: argparse.Namespace,
    command: str,
    info: dict | None,
    results: list[Result],
    failures: dict[str, str] | None = None,
) -> str:
    """docs/mfu.md; with no results (no GPU yet) it says so, keeping the method and the command."""
    from distrain.model.size import flops_per_token, num_params

    cfg = compose(overrides(args, args.variants[0], Path("/tmp")))
    fpt = flops_per_token(cfg.model, args.seq_len)
    h100 = 989e12
    lines = [
        "# MFU: the ~1B model on one GPU",
        "",
        f"`jobs/bench_mfu.py` trains `model={args.model}` ({num_params(cfg.model) / 1e9:.2f} B parameters) on one GPU",
        "with FSDP at world size 1 (`strategy=zero3 cluster.num_workers=1`) in bf16 autocast, through",
        "distrain's own driver (`distrain.launch.train` on the config Hydra composes from `conf/`, Ray",
        "worker included), once eager (`strategy.compile=false`) and once with each block compiled",
        "(`strategy.compile=true`), and reports tokens/s and model FLOPs utilisation side by side. The goal",
        f"is ≥ {GOAL:.0%} MFU on an H100.",
        "",
        "```bash",
        command,
        "```",
        "",
        f"- Settings: global batch {args.global_batch} × {args.seq_len} tokens "
        f"({args.global_batch * args.seq_len:,} tokens per step), micro-batch {args.micro_batch} "
        f"({args.global_batch // args.micro_batch} micro-batch(es) per step), AdamW, {args.steps} steps per run; "
        "`checkpoint.interval=0 trainer.eval_interval=0 logger.wandb.mode=disabled`"
        + (f", plus `{' '.join(args.overrides)}`" if args.overrides else "")
        + ".",
        f"- Each number is the median over steps {args.warmup + 1}–{args.steps} of what the trainer logs in",
        "  `metrics.jsonl` (`tokens_per_s`, `mfu`, `step_time_s`); the first steps (compilation, the",
        "  allocator's growth) are left out. The trainer's step time leaves out validation and checkpoint",
        "  saving, so the final ones (which always run) do not count.",
        "- Launch → first step is summary.json's `first_step_s`: Ray's start, placement, model build, and",
        "  with compile the compilation of the first step.",
        "",
        "## How MFU is computed",
        "",
        "```",
        "MFU = flops_per_token × tokens/s ÷ (peak bf16 FLOP/s × world size)",
        "```",
        "",
        "- `flops_per_token` (`distrain/model/llama.py`) counts training FLOPs, forward and backward: 6 per",
        "  weight that multiplies the token (every matrix but the embedding lookup) plus the attention",
        "  scores and their weighted sum, 2 · seq_len · dim each per layer, halved by the causal mask, times",
        "  3 for the backward pass, i.e. `6 · matmul weights + 6 · n_layers · seq_len · dim`. Activation",
        "  recomputation is not counted (it is hardware FLOPs, not model FLOPs).",
        f"- For `{args.model}` at seq_len {args.seq_len}: {fpt / 1e9:.2f} GFLOP per token.",
        "- The peak is the dense bf16 tensor-core figure of the device (`distrain/train/metrics.py`:",
        "  H100 SXM 989 TFLOP/s, H100 PCIe 756, H100 NVL 835, H200 989, A100 312); `mfu` is logged only",
        "  for these and only in bf16. `--peak-tflops` gives the figure for another GPU.",
        f"- {GOAL:.0%} MFU on an H100 SXM is therefore {GOAL * h100 / fpt:,.0f} tokens/s for this model and sequence",
        "  length.",
        "",
        "## Results",
        "",
    ]
    if not results:
        lines += [
            "Not yet measured on a GPU. The machines this was written on have no GPU, where the benchmark",
            "only prints that MFU needs one and exits 0. Run the command above on an H100 to fill this in.",
            "",
        ]
        return "\n".join(lines)
    by = {r.variant: r for r in results}
    lines += [
        f"- Machine: {info['gpu']}; torch {info['torch']} (CUDA {info['cuda']}), ray {info['ray']}, "
        f"Python {info['python']}.",
        "",
        *table(results, failures),
        "",
    ]
    if "eager" in by and "compiled" in by:
        extra = by["compiled"].first_step_s - by["eager"].first_step_s
        lines.append(
            f"Compiling the blocks gives {by['compiled'].tokens_per_s / by['eager'].tokens_per_s:.2f}× the "
            f"eager throughput and reaches the first step {abs(extra):.0f} s {'later' if extra >= 0 else 'sooner'}."
        )
    best = max((r for r in results if r.mfu is not None), key=lambda r: r.mfu, default=None)
    if best is not None:
        verdict = "meets" if best.mfu >= GOAL else "falls short of"
        lines.append(f"The best run ({best.variant}, {best.mfu:.1%} MFU) {verdict} the goal of ≥ {GOAL:.0%}.")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    exe = os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT)) else sys.executable
    command = shlex.join([exe, "jobs/bench_mfu.py", *(sys.argv[1:] if argv is None else argv)])
    import torch

    if not torch.cuda.is_available():
        for variant in args.variants:  # still catch a bad override here, without Ray or a GPU
            compose(overrides(args, variant, Path(tempfile.gettempdir())))
        print(
            "bench_mfu: no GPU here (torch.cuda.is_available() is False): MFU is measured against a GPU's bf16 "
            "peak, so nothing was measured. The configs compose and validate; run this on a GPU machine."
        )
        return
    if os.environ.get("RAY_ADDRESS") in (None, "", "local"):
        # An embedded cluster, on loopback only; Ray reads this when it is imported, hence before distrain.launch.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from distrain.cluster.placement import WorkerFailure
    from distrain.launch import train
    from distrain.train.metrics import peak_flops

    known = peak_flops(torch.device("cuda", 0), "bf16")
    peak = args.peak_tflops * 1e12 if args.peak_tflops else known
    if peak is None:
        print(f"bench_mfu: no bf16 peak known for {torch.cuda.get_device_name(0)}: MFU is left out (--peak-tflops)")
    storage = Path(args.storage or tempfile.mkdtemp(prefix="bench_mfu_"))
    results: list[Result] = []
    failures: dict[str, str] = {}  # variant → why it failed (an OOM, compile unsupported): the other still runs
    try:
        for variant in args.variants:
            cfg = compose(overrides(args, variant, storage))
            run_dir = Path(cfg.run_dir)
            if run_dir.exists():
                raise SystemExit(f"bench_mfu: {run_dir} exists and would be resumed; use another --storage")
            print(f"bench_mfu: {variant}: {args.steps} steps of {args.model} ...", flush=True)
            try:
                train(cfg)
            except WorkerFailure as e:
                failures[variant] = str(e)
                print(f"bench_mfu: {variant} failed: {e}", file=sys.stderr, flush=True)
                continue
            finally:
                shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # ~12 GB each for the 1B model
            results.append(measure(variant, run_dir, args.warmup, peak))
            r = results[-1]
            mfu = f"{r.mfu:.1%}" if r.mfu is not None else "n/a"
            print(f"bench_mfu: {variant}: {r.tokens_per_s:,.0f} tokens/s, MFU {mfu}, step {r.step_time_s:.3f}s")
    finally:
        ray.shutdown()
        if args.storage is None:
            shutil.rmtree(storage, ignore_errors=True)
    print("\n" + "\n".join(table(results, failures)))
    if args.out and results:
        out = ROOT / args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(markdown(args, command, machine(), results, failures))
        print(f"wrote {out}")
    if failures:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
