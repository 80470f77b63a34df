"""Tokens/s and MFU of a ~1B model on one GPU, beside a plain loop and transformers:  python jobs/bench/bench_mfu.py

Trains `model=llama_1b` in bf16 three ways, on the same job (batch, micro-batch, seq_len, AdamW, data),
eager (`strategy.compile=false`) and with each block compiled (`strategy.compile=true`), and distrain once more
compiled with its blocks' matmuls in float8 (variant `float8`: `trainer.float8=tensorwise`, torchao; a GPU of
compute capability ≥ 8.9; goal ≥ 1.2× its compiled bf16 tokens/s, as torchtitan's +28% on an H100):

- **distrain**, through its own driver (`distrain.driver.launch.train`, Ray worker included) with FSDP at world
  size 1 (`strategy=zero3 cluster.num_workers=1`); its metrics.jsonl gives each step's figures;
- **plain loop**: distrain's model class built directly (its contract: on the meta device, then
  `init_weights()`) in a plain PyTorch loop, no Ray, no FSDP (jobs/bench/mfu_loop.py), AdamW fused;
- **transformers**: Hugging Face's implementation of the same shape (`LlamaForCausalLM`, `GPT2LMHeadModel`;
  its config from `distrain.model.hf.hf_config`) in that same loop, its decoder layers compiled alike;
  left out for a model family transformers lacks.

The two loops run as commands of their own (distrain/testing/processes.py), so each finds the GPU free and gives its
memory back. The order of the runs alternates over the repeats. Each run's figures are medians over the
steps after --warmup: tokens/s, MFU (the same FLOPs per token for all three: the model contract's
`flops_per_token`), step time; then the ratios distrain ÷ plain loop and distrain ÷ transformers. The goals,
on one H100/H200: distrain ≥ 1.0× the plain loop, and ≥ 50% MFU. Writes docs/mfu.md and, with --json, each
run's numbers. Needs a GPU: without one it says so and exits 0, writing no page (MFU is only defined against
a GPU's bf16 peak); --smoke there runs all three on the CPU, eager, to check that the benchmark works, its
page under --storage (a temporary directory) unless --out names a place outside docs/.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import harness  # first: it keeps Ray on loopback

from distrain.testing import processes

GOAL = 0.50  # MFU on an H100
RATIO_GOAL = 1.0  # distrain's tokens/s ÷ the plain loop's
FLOAT8_GOAL = 1.2  # distrain's float8 tokens/s ÷ its compiled bf16's
VARIANTS = {
    "eager": ("strategy.compile=false",),
    "compiled": ("strategy.compile=true",),
    "float8": ("strategy.compile=true", "trainer.float8=tensorwise"),  # distrain only: the loops have no float8
}
SIDES = {"distrain": "distrain", "plain": "plain loop", "transformers": "transformers"}
TIMEOUT_S = 1800.0  # one run
# distrain on one GPU: FSDP at world size 1, bf16 (jobs/bench/bench_checkpoint.py's GPU mode trains the same way).
ONE_GPU = ["strategy=zero3", "cluster.num_workers=1", "trainer.precision=bf16"]
# The job: sequences per step, per forward/backward (8, not 4: on an H100 micro-batch 4 gave 49.6% MFU
# compiled, 8 gave 54.0%), tokens per sequence.
BATCH = {"global_batch_size": 16, "micro_batch_size": 8, "seq_len": 2048}


@dataclass
class Result:
    tokens_per_s: float  # medians over the steps after the warm-up
    step_time_s: float
    mfu: float | None  # None: the device's bf16 peak is unknown and --peak-tflops was not given
    peak_memory_gib: float
    first_step_s: float  # launch → first completed step: Ray and placement (distrain), model build, compilation
    final_loss: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.parser(__doc__, "docs/mfu.md", repeats=1)
    p.add_argument("--model", default="llama_1b", help="a conf/model/*.yaml name (default llama_1b)")
    p.add_argument("--steps", type=int, default=30, help="training steps per run (default 30)")
    p.add_argument("--warmup", type=int, default=10, help="first steps left out: compilation, allocator (default 10)")
    b = BATCH
    p.add_argument(
        "--global-batch",
        type=int,
        default=b["global_batch_size"],
        help=f"sequences per step (default {b['global_batch_size']})",
    )
    p.add_argument(
        "--micro-batch",
        type=int,
        default=b["micro_batch_size"],
        help=f"sequences per forward/backward (default {b['micro_batch_size']})",
    )
    p.add_argument("--seq-len", type=int, default=b["seq_len"], help=f"tokens per sequence (default {b['seq_len']})")
    p.add_argument(
        "--variants", default=None, help=f"a subset of {','.join(VARIANTS)} (default both; smoke without a GPU eager)"
    )
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, if distrain lacks it")
    p.add_argument("--json", default=None, metavar="PATH", help="also write each run's numbers as JSON")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = harness.parse(p, argv)
    import torch

    args.gpu = torch.cuda.is_available()
    if args.smoke:
        args.model, args.steps, args.warmup, args.seq_len = "nano", 4, 1, 32
    # Without a GPU, inductor's compilation of the blocks takes minutes of CPU: the smoke leaves it out (and float8,
    # whose emulation on the CPU does not compile).
    default = ",".join(VARIANTS) if args.gpu else "eager"
    args.variants = [v.strip() for v in (args.variants or default).split(",") if v.strip()]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown or not args.variants:
        p.error(f"--variants: unknown {', '.join(unknown) or '(none given)'}; choose from {','.join(VARIANTS)}")
    if args.steps < args.warmup + 3:
        p.error(f"--steps={args.steps} leaves fewer than 3 steps after --warmup={args.warmup}")
    return args


def sides(cfg) -> list[str]:
    """distrain and the plain loop; transformers too where it is installed and has the model's family."""
    from distrain.config import ConfigError
    from distrain.model.hf import hf_config

    try:
        hf_config(cfg.model, cfg.trainer.seq_len)
    except ConfigError as e:
        print(f"bench_mfu: no transformers run: {e}")
        return ["distrain", "plain"]
    if importlib.util.find_spec("transformers") is None:
        print("bench_mfu: no transformers run: it is not installed (pip install -e '.[hf]')")
        return ["distrain", "plain"]
    return list(SIDES)


def overrides(args: argparse.Namespace, variant: str, storage: Path, name: str) -> list[str]:
    """The Hydra overrides of one run: `python jobs/train.py <these>` trains the same thing."""
    return [
        f"model={args.model}",
        *ONE_GPU,
        *VARIANTS[variant],
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


def run(key: tuple[str, str], repeat: int, args: argparse.Namespace, storage: Path, fpt: float, peak: float | None):
    """One run: its medians over the steps after the warm-up (Result), or what went wrong (an OOM, compile
    unsupported) in one line: the other runs still go on. MFU from `fpt` (FLOPs per token) and the device's
    `peak` for every side alike."""
    side, variant = key
    name = f"mfu-{side}-{variant}-{repeat}"
    if side == "distrain":  # the trainer's step_time_s leaves out validation and checkpointing
        trained = harness.train(overrides(args, variant, storage, name), TIMEOUT_S)
        shutil.rmtree(Path(trained.cfg.run_dir, "checkpoints"), ignore_errors=True)  # ~12 GB each for the 1B model
        records, error, first_step_s = trained.metrics, trained.error, trained.summary.get("first_step_s", 0.0)
    else:
        records, error, first_step_s = loop(side, args, variant, storage, name)
    records = [r for r in records if r["step"] > args.warmup]
    if error or not records:
        print(f"bench_mfu: {name} failed: {error or 'no steps after the warm-up'}", file=sys.stderr)
        return error or "no steps after the warm-up"
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in records)
    result = Result(
        tokens_per_s,
        statistics.median(r["step_time_s"] for r in records),
        fpt * tokens_per_s / peak if peak else None,  # world size 1
        max(r["peak_memory_bytes"] for r in records) / 2**30,
        first_step_s,
        records[-1]["loss"],
    )
    mfu = f"MFU {result.mfu:.1%}" if result.mfu is not None else "MFU —"
    print(f"bench_mfu: {name}: {tokens_per_s:,.0f} tokens/s, {mfu}, step {result.step_time_s:.3f}s", flush=True)
    return result


def loop(side: str, args: argparse.Namespace, variant: str, storage: Path, name: str) -> tuple[list, str | None, float]:
    """`python jobs/bench/mfu_loop.py <side> <distrain's overrides>` as a command of its own: its step records,
    what went wrong, and the seconds from its launch to the end of its first step."""
    cmd = [sys.executable, "jobs/bench/mfu_loop.py", side, *overrides(args, variant, storage, name)]
    try:
        done = processes.run_command(cmd, storage / f"{name}.log", TIMEOUT_S)
    except processes.CommandTimeout as e:
        return [], str(e).splitlines()[0], 0.0
    lines = done.log.read_text(errors="replace").splitlines()
    records = [json.loads(line) for line in lines if line.startswith('{"step"')]
    error = f"exited with {done.rc}: {(lines or [''])[-1]}" if done.rc else None
    return records, error, records[0]["time"] - done.started if records else 0.0


def table(trials: list[harness.Trial]) -> list[str]:
    rows = []
    for t in sorted(trials, key=lambda t: (list(SIDES).index(t.key[0]), t.key[1], t.repeat)):
        r, label = t.result, f"{SIDES[t.key[0]]}, {t.key[1]}"
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


def ratios(trials: list[harness.Trial]) -> dict[str, dict[str, float]]:
    """variant → side → distrain's median tokens/s ÷ that side's, where both ran."""
    speed = {
        key: statistics.median(t.result.tokens_per_s for t in ts)
        for key, ts in harness.by_key([t for t in trials if isinstance(t.result, Result)]).items()
    }
    out = {
        variant: {
            side: speed["distrain", variant] / speed[side, variant]
            for side in ("plain", "transformers")
            if ("distrain", variant) in speed and (side, variant) in speed
        }
        for variant in VARIANTS
    }
    return {variant: r for variant, r in out.items() if r}


def float8_speedup(trials: list[harness.Trial]) -> float | None:
    """distrain's median tokens/s in float8 ÷ compiled in bf16, where both ran."""
    speed = {
        key: statistics.median(t.result.tokens_per_s for t in ts)
        for key, ts in harness.by_key([t for t in trials if isinstance(t.result, Result)]).items()
    }
    if ("distrain", "float8") in speed and ("distrain", "compiled") in speed:
        return speed["distrain", "float8"] / speed["distrain", "compiled"]
    return None


def body(args: argparse.Namespace, trials: list[harness.Trial], fpt: float) -> str:
    from distrain.driver.cli import compose
    from distrain.model.size import num_params

    cfg, h100 = compose(overrides(args, args.variants[0], Path("/tmp"), "plan")), 989e12
    ran = sorted({t.key[0] for t in trials}, key=list(SIDES).index)
    lines = [
        f"`model={args.model}` ({num_params(cfg.model) / 1e9:.3g} B parameters) in bf16 on one GPU, the same job",
        f"three ways, side by side in one run ({', '.join(SIDES[s] for s in ran)} here):",
        "",
        "- **distrain**: through its own driver (`distrain.driver.launch.train`, Ray worker included), FSDP at world",
        "  size 1 (`strategy=zero3 cluster.num_workers=1`);",
        "- **plain loop**: distrain's model class built directly (on the meta device, then `init_weights()`)",
        "  in a plain PyTorch loop (`jobs/bench/mfu_loop.py`): no Ray, no FSDP, fp32 weights under bf16 autocast,",
        "  AdamW (fused on a GPU), gradient clipping, the same batches, a command of its own;",
        "- **transformers**: Hugging Face's implementation of the same shape (config from",
        "  `distrain.model.hf.hf_config`, SDPA attention) in that same loop, a command of its own.",
        "",
        "Each eager (`strategy.compile=false`) and with each block compiled on its own (`strategy.compile=true`:",
        "distrain's blocks, the plain loop's the same way, transformers' decoder layers alike); distrain once more",
        "compiled with its blocks' matmuls in float8 (`float8`: `trainer.float8=tensorwise`). Goals on one",
        f"H100/H200: distrain ≥ {RATIO_GOAL:.1f}× the plain loop's tokens/s, ≥ {GOAL:.0%} MFU, and float8 ≥ "
        f"{FLOAT8_GOAL:.1f}× distrain's compiled bf16 tokens/s.",
        "",
        f"- Settings: global batch {args.global_batch} × {args.seq_len} tokens "
        f"({args.global_batch * args.seq_len:,} tokens per step), micro-batch {args.micro_batch} "
        f"({args.global_batch // args.micro_batch} micro-batch(es) per step), AdamW, {args.steps} steps per run, "
        f"{args.repeats} run(s) of each, the order alternating; `checkpoint.interval=0 "
        "trainer.eval_interval=0 logger.wandb.mode=disabled`"
        + (f", plus `{' '.join(args.overrides)}`" if args.overrides else "")
        + ".",
        f"- Each number is the median over steps {args.warmup + 1}–{args.steps} of each step's figures: distrain's",
        "  `metrics.jsonl` (`tokens_per_s`, `step_time_s`), the loops' own lines, timed the same way (a step",
        "  ends when the next is queued and its own loss read back); the first steps (compilation, the",
        "  allocator's growth) are left out. Launch → first step: for distrain summary.json's `first_step_s`",
        "  (Ray's start, placement, model build, compilation), for a loop from its command's start.",
        "- MFU = flops_per_token × tokens/s ÷ peak bf16 FLOP/s, the same for all three. `flops_per_token`",
        "  (the model contract's, `distrain/model/size.py`) counts training FLOPs, forward and backward, as",
        "  PaLM does: 6 per weight that multiplies the token plus the attention scores and their weighted sum,",
        "  `12 · L · H · Q · T`; activation recomputation is not counted. For "
        f"`{args.model}` at seq_len {args.seq_len}: {fpt / 1e9:.2f} GFLOP per token.",
        "- The peak is the dense bf16 tensor-core figure of the device (`distrain/train/metrics.py`);",
        f"  `--peak-tflops` gives it for another GPU. {GOAL:.0%} MFU on an H100 SXM (989 TFLOP/s) is "
        f"{GOAL * h100 / fpt:,.0f} tokens/s here.",
        "",
        *table(trials),
        "",
    ]
    rows = [
        [v, *(f"**{r[s]:.3f}**" if s in r else "—" for s in ("plain", "transformers"))]
        for v, r in ratios(trials).items()
    ]
    if rows:
        head = ["blocks", "distrain ÷ plain loop", "distrain ÷ transformers"]
        lines += ["Tokens/s, medians over the repeats:", "", *harness.table(head, rows), ""]
        for variant, r in ratios(trials).items():
            if "plain" in r:
                verdict = "meets" if r["plain"] >= RATIO_GOAL else "falls short of"
                lines.append(
                    f"With {variant} blocks distrain runs at {r['plain']:.3f}× the plain loop's tokens/s: it {verdict} "
                    f"the goal of ≥ {RATIO_GOAL:.1f}×."
                )
    done = {k: [t.result for t in ts if isinstance(t.result, Result)] for k, ts in harness.by_key(trials).items()}
    if done.get(("distrain", "eager")) and done.get(("distrain", "compiled")):
        speed = statistics.median(r.tokens_per_s for r in done["distrain", "compiled"]) / statistics.median(
            r.tokens_per_s for r in done["distrain", "eager"]
        )
        lines.append(f"Compiling the blocks gives distrain {speed:.2f}× its eager throughput (medians over the runs).")
    if (f8 := float8_speedup(trials)) is not None:
        verdict = "meets" if f8 >= FLOAT8_GOAL else "falls short of"
        lines.append(
            f"float8 (tensorwise, compiled) gives distrain {f8:.2f}× its compiled bf16 tokens/s: it {verdict} the goal "
            f"of ≥ {FLOAT8_GOAL:.1f}× (its MFU is still counted against the bf16 peak)."
        )
    # the bf16 runs': float8's MFU is counted against the bf16 peak too, which its matmuls are not bound by
    bf16 = [rs for (side, v), rs in done.items() if side == "distrain" and v != "float8"]
    ours = [r for rs in bf16 for r in rs if r.mfu is not None]
    if best := max(ours, key=lambda r: r.mfu, default=None):
        verdict = "meets" if best.mfu >= GOAL else "falls short of"
        lines.append(f"distrain's best run ({best.mfu:.1%} MFU) {verdict} the goal of ≥ {GOAL:.0%}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from distrain.driver.cli import compose
    from distrain.model.size import flops_per_token

    if not args.gpu and not args.smoke:
        print(
            "bench_mfu: needs a GPU (torch.cuda.is_available() is False): MFU is measured against a GPU's bf16 "
            "peak, so nothing was measured and no page written. Run it on a GPU machine (--smoke checks it here)."
        )
        return
    peak = None
    if args.gpu:
        from distrain.train.metrics import peak_flops

        peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(torch.device("cuda", 0), "bf16")
        if peak is None:
            print(f"bench_mfu: no bf16 peak known for {torch.cuda.get_device_name(0)}: MFU is left out (--peak-tflops)")
    cfg = compose(overrides(args, args.variants[0], Path("/tmp"), "plan"))
    fpt = flops_per_token(cfg.model, args.seq_len)
    keys = [(side, v) for v in args.variants for side in (sides(cfg) if v != "float8" else ["distrain"])]
    page = harness.Page("MFU: the ~1B model on one GPU, beside a plain loop and transformers", args)
    with harness.storage(args) as storage:
        if not args.gpu and args.out and Path(args.out).resolve().parent == harness.DOCS:
            args.out = str(storage / "docs" / Path(args.out).name)  # docs/ holds GPU figures only
        with harness.ray_cluster():
            trials = harness.alternate(
                keys, args.repeats, lambda k, r: run(k, r, args, storage, fpt, peak), label=", ".join
            )
        print("\n".join(table(trials)))
        page.write(body(args, trials, fpt), trials)
    if args.json:
        runs = [
            {"side": t.key[0], "variant": t.key[1], "repeat": t.repeat}
            | (asdict(t.result) if isinstance(t.result, Result) else {"error": t.result})
            for t in trials
        ]
        device = torch.cuda.get_device_name(0) if args.gpu else "cpu"
        raw = {"command": args.command, "device": device, "goal": GOAL, "ratio_goal": RATIO_GOAL, "runs": runs}
        raw |= {"float8_goal": FLOAT8_GOAL, "float8_speedup": float8_speedup(trials)}
        Path(args.json).write_text(json.dumps(raw | {"ratios": ratios(trials)}, indent=1) + "\n")
        print(f"bench_mfu: wrote {args.json}")
    if any(isinstance(t.result, str) for t in trials):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
