"""The GPU figures in one command:  python jobs/gpu_check.py  (make gpu-check)

On a machine with G ≥ 1 GPUs (`torch.cuda.device_count()`) it runs, one console line per part (PASS, FAIL
or SKIP, and its figure), then a summary, and exits 1 if any part failed:

1. **strategies**: a short NCCL run of every preset in conf/strategy/ that fits on G GPUs, through
   distrain's own driver (`distrain.launch.train`, what `python jobs/train.py` runs): `model=nano`, 20
   steps, `trainer.precision=bf16`. Each gets the most workers ≤ G its layout accepts; tp, pp, hsdp and
   fsdp_tp need 2, 3d and tp2d 4, tp2p5d and tp3d 8, and a preset that needs more than G is skipped,
   saying so. Their degrees are not lowered to fit: at tp=1, pp=1 or dp_shard=1 a preset runs ddp's or
   zero3's code, not its own. It passes when every logged loss is finite and the last is below the
   first. (strategy=ps trains through Ray's object store, not NCCL: jobs/bench_ps.py covers it.)
2. **bf16 against fp32**: ddp's run again in fp32, on the same seed, data and workers. It passes when the
   final losses are within 2% of each other (relative). bf16 autocast rounds every matmul input to 8
   mantissa bits (0.4%), so the curves drift apart a little: over 20 steps of the nano model they stayed
   within 0.7% at every step and 0.01% at the last (CPU autocast, fp32 weights either way). A broken
   mixed-precision path (weights or gradients kept in bf16, a cast lost) moves the loss by far more.
3. **MFU**: jobs/bench_mfu.py, llama_1b in bf16 with compiled blocks, distrain beside a plain PyTorch loop
   and transformers (the ratios are reported): writes docs/mfu.md. It passes when distrain's best run
   reaches the goal, ≥ 50% MFU (set for one H100).
4. **collectives**: jobs/bench_collectives.py on every GPU (NCCL), against torch.distributed's plain
   processes on the same GPUs (--repeats passes of each, alternating): writes docs/collectives.md. It
   passes when every operation's bandwidth ratio is ≥ 0.95; on one GPU, where nothing crosses a link,
   the ratio is only reported.

Parts 1 and 2 write docs/gpu.md (--out); every page's header names the GPU. The benchmarks run as commands
of their own, so their pages name their own command and each finds the GPU free.

The budget on one H100, under the 10 minutes one command may take (timed on one, 2026-11-24, docs/gpu.md):

| part                                                                  | seconds |
| --------------------------------------------------------------------- | ------: |
| 1. Ray's start and ddp at 1 worker (CUDA, NCCL), 20 steps             |      18 |
| 1. zero1, zero2, zero3, offload at 1 worker, kept warm, 20 steps each |      15 |
| 1. nvme at 1 worker (not yet timed on a GPU)                          |       — |
| 2. ddp in fp32                                                        |       2 |
| 3. bench_mfu: 3 runs of llama_1b × 30 steps, compiled (not yet timed) |       — |
| 4. bench_collectives: 1 KB–256 MB, 2 passes of each side              |     184 |
| total (366 s with part 3 as 2 distrain runs, eager and compiled: 134) |       — |

Without a GPU it runs in CPU mode, which checks that the scripts work: the same parts at tiny sizes (the
tests' tiny model, 8 steps; gloo; --workers CPU workers in place of GPUs, default 1 as on one H100; bf16
is CPU autocast), the benchmarks' --smoke, and every page under the storage directory's docs/ (temporary
unless --storage), never docs/. The figures are then still to be taken on a GPU, which it says. --smoke
does the same on a GPU machine, on its GPUs.

On a GPU machine torch must be a CUDA build: from a fresh clone, `make gpu-check TORCH=torch` installs it
(the Makefile's TORCH; an existing .venv keeps the build it has).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import harness  # first: it keeps Ray on loopback
import processes

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "offload", "nvme", "tp", "pp", "hsdp", "fsdp_tp", "3d")
STRATEGIES += ("tp2d", "tp2p5d", "tp3d")  # 4 and 8 GPUs
TOLERANCE = 0.02  # bf16's final loss against fp32's, relative
MOST_WORKERS = 64  # how far to look for the worker count a preset needs
RUN = ["checkpoint.interval=0", "trainer.eval_interval=0", "trainer.eval_batches=1", "cluster.reuse_workers=true"]
RUN += ["logger.wandb.mode=disabled", "logger.progress_interval_s=600", "optim.warmup_steps=5"]


@dataclass
class Part:
    name: str
    status: str  # PASS | FAIL | SKIP
    figure: str
    seconds: float = 0.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.parser(__doc__, "docs/gpu.md", repeats=2)
    p.add_argument("--steps", type=int, default=20, help="training steps of each strategy run (default 20, CPU 8)")
    p.add_argument("--workers", type=int, default=1, help="CPU mode: CPU workers in place of GPUs (default 1)")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="presets to run (default: all but ps)")
    args = harness.parse(p, argv)
    import torch

    args.gpus = torch.cuda.device_count()
    if not args.gpus:
        args.smoke = True
    if args.smoke:
        args.steps = min(args.steps, 8)
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if args.steps < 2 or args.workers < 1:
        p.error("--steps must be at least 2 and --workers at least 1")
    return args


def plural(n: int, unit: str) -> str:
    return f"{n} {unit}{'' if n == 1 else 's'}"


def report(part: Part, began: float) -> Part:
    """The part's console line, with the seconds it took since `began`."""
    part.seconds = time.time() - began
    print(f"{part.status}  {part.name} ({part.seconds:.0f} s): {part.figure}", flush=True)
    return part


# -- 1 and 2: training runs ---------------------------------------------------------------------


def overrides(args: argparse.Namespace, storage: Path) -> list[str]:
    """What every training run shares (`python jobs/train.py <these>` trains the same thing)."""
    size = harness.TINY if args.smoke else []
    device = "cluster.use_gpu=true" if args.gpus else "cluster.use_gpu=false"
    return ["model=nano", *size, f"trainer.max_steps={args.steps}", device, *RUN, f"run.storage={storage}"]


def workers_for(name: str, common: list[str], most: int, unit: str) -> tuple[int | None, str]:
    """The most workers ≤ `most` preset `name`'s layout accepts; or None and what it needs."""
    from distrain.cli import compose
    from distrain.config import ConfigError
    from distrain.validation import validate

    cfg = compose([*common, f"strategy={name}", "run.name=plan"])

    def fits(n: int) -> bool:
        cfg.cluster.num_workers = n
        try:
            validate(cfg)
        except ConfigError:
            return False
        return True

    if fit := next((n for n in range(most, 0, -1) if fits(n)), None):
        return fit, ""
    s = cfg.strategy
    degrees = " × ".join(f"{k} {v}" for k, v in (("tp", s.tp), ("pp", s.pp), ("dp_shard", s.dp_shard)) if v > 1)
    need = next((n for n in range(most + 1, MOST_WORKERS + 1) if fits(n)), None)
    return None, f"needs {plural(need, unit) if need else f'more than {MOST_WORKERS}'} ({degrees})"


def train(common: list[str], name: str, workers: int, precision: str) -> harness.Trained:
    run = [f"strategy={name}", f"cluster.num_workers={workers}", f"trainer.precision={precision}"]
    return harness.train([*common, *run, f"run.name={name}-{precision}"], timeout_s=300)


def strategy_part(trained: harness.Trained, name: str, workers: int, unit: str) -> Part:
    losses = [m["loss"] for m in trained.metrics]
    label = f"strategy {name} ({plural(workers, unit)})"
    if trained.error or not losses:
        return Part(label, "FAIL", trained.error or "no step logged")
    curve = f"loss {losses[0]:.4f} → {losses[-1]:.4f} over {len(losses)} steps"
    if not all(math.isfinite(x) for x in losses):
        return Part(label, "FAIL", f"{curve}: not finite")
    if losses[-1] >= losses[0]:
        return Part(label, "FAIL", f"{curve}: not falling")
    return Part(label, "PASS", curve)


def agreement_part(bf16: harness.Trained, fp32: harness.Trained) -> Part:
    label = "bf16 against fp32 (ddp)"
    a, b = [m["loss"] for m in bf16.metrics], [m["loss"] for m in fp32.metrics]
    if bf16.error or fp32.error or not a or len(a) != len(b):
        return Part(label, "FAIL", bf16.error or fp32.error or "the runs logged different steps")
    final = abs(a[-1] - b[-1]) / b[-1]
    most = max(abs(x - y) / y for x, y in zip(a, b, strict=True))
    figure = (
        f"final loss {a[-1]:.4f} against {b[-1]:.4f}: {final:.3%} apart (tolerance {TOLERANCE:.0%}); "
        f"at most {most:.3%} at any step"
    )
    return Part(label, "PASS" if final <= TOLERANCE else "FAIL", figure)


def training(args: argparse.Namespace, storage: Path) -> tuple[list[Part], list[str]]:
    """Parts 1 and 2, on one embedded cluster: their lines, and their section of docs/gpu.md."""
    common = overrides(args, storage)
    most, unit = (args.gpus, "GPU") if args.gpus else (args.workers, "CPU worker")
    parts, rows, done = [], [], {}
    with harness.ray_cluster():
        for name in args.strategies:
            began = time.time()
            workers, need = workers_for(name, common, most, unit)
            if workers is None:
                parts.append(report(Part(f"strategy {name}", "SKIP", need), began))
                rows.append([name, "—", "skipped"])
                continue
            done[name] = train(common, name, workers, "bf16")
            parts.append(report(strategy_part(done[name], name, workers, unit), began))
            rows.append([name, workers, mesh(done[name])])
        began = time.time()
        workers, _ = workers_for("ddp", common, most, unit)
        bf16 = done.get("ddp") or train(common, "ddp", workers, "bf16")
        parts.append(report(agreement_part(bf16, train(common, "ddp", workers, "fp32")), began))
    head = ["strategy", f"{unit}s", "mesh"]
    section = [
        "## Strategies",
        "",
        f"`python jobs/train.py {' '.join(common[:-1])} strategy=<name> cluster.num_workers=<n> "
        "trainer.precision=bf16`, each preset on the most workers its layout accepts (a preset that needs more "
        "is skipped). A run passes when every logged loss is finite and the last is below the first.",
        "",
        *harness.table(head, rows, "lrl"),
        "",
        f"bf16 against fp32: ddp's run again with `trainer.precision=fp32`, on the same seed, data and workers; "
        f"the final losses must agree within {TOLERANCE:.0%} (relative): bf16 autocast's rounding moves them "
        "far less, a broken mixed-precision path far more.",
        "",
    ]
    return parts, section


def mesh(trained: harness.Trained) -> str:
    """The run's mesh, e.g. 'tp 2 × dp_shard 2'."""
    return " × ".join(f"{k} {v}" for k, v in trained.layout.sizes().items() if v > 1) or "1 rank"


# -- 3 and 4: the benchmarks ----------------------------------------------------------------------


def bench(args: argparse.Namespace, script: str, pages: Path, storage: Path, *extra: str) -> tuple[dict, str]:
    """`python jobs/<script>.py` with its page in `pages` and its numbers in JSON; those numbers ({} if it
    wrote none) and what went wrong, if anything."""
    out = storage / f"{script}.json"
    cmd = [sys.executable, f"jobs/{script}.py", "--out", str(pages / f"{script.removeprefix('bench_')}.md")]
    cmd += ["--json", str(out), "--storage", str(storage / script), *(["--smoke"] if args.smoke else []), *extra]
    try:
        done = processes.run_command(cmd, storage / f"{script}.log", timeout_s=480)
    except processes.CommandTimeout as e:
        return {}, str(e).splitlines()[0]
    if done.rc != 0:
        print(done.tail(), file=sys.stderr)
        return {}, f"exited with {done.rc} (log above)"
    return harness.read_json(out, {}), ""


def mfu_part(args: argparse.Namespace, pages: Path, storage: Path) -> Part:
    label = "MFU (jobs/bench_mfu.py)"
    # The compiled blocks only: their best is what the goal is about, and eager's three runs would take the
    # part past its budget.
    raw, error = bench(args, "bench_mfu", pages, storage, *([] if args.smoke else ["--variants", "compiled"]))
    if error or not raw:
        return Part(label, "FAIL", error or "it wrote no numbers")
    sides = ", ".join(sorted({r["side"] for r in raw["runs"]}))
    if not args.gpus:
        return Part(label, "PASS", f"ran ({sides}); without a GPU it measures nothing, as it should")
    ran = [r for r in raw["runs"] if r["side"] == "distrain" and r.get("mfu") is not None]
    if not ran:
        return Part(label, "FAIL", f"no MFU: no bf16 peak known for {raw['device']} (--peak-tflops)")
    best = max(ran, key=lambda r: r["mfu"])
    each = ", ".join(f"{r['variant']} {r['mfu']:.1%} ({r['tokens_per_s']:,.0f} tokens/s)" for r in ran)
    against = ", ".join(f"÷ {side} {x:.3f} ({v})" for v, r in raw["ratios"].items() for side, x in r.items())
    held = not args.smoke
    ok = not held or best["mfu"] >= raw["goal"]
    figure = f"distrain {each}; goal ≥ {raw['goal']:.0%}; distrain {against}" + ("" if held else " (smoke)")
    return Part(label, "PASS" if ok else "FAIL", figure)


def collectives_part(args: argparse.Namespace, pages: Path, storage: Path) -> Part:
    label = "collectives (jobs/bench_collectives.py)"
    raw, error = bench(
        args, "bench_collectives", pages, storage, *([] if args.smoke else ["--repeats", str(args.repeats)])
    )
    if error or not raw.get("ratios"):
        return Part(label, "FAIL", error or "no operation ran on both sides")
    ratios = raw["ratios"]
    low = min(ratios, key=ratios.get)
    # gloo on loopback, smoke sizes, or one GPU (nothing crosses a link): the figures are only reported
    held = raw["run"]["backend"] == "nccl" and raw["run"]["world_size"] > 1 and not args.smoke
    ok = not held or ratios[low] >= raw["goal"]
    figure = f"{raw['run']['world_size']} rank(s), {raw['run']['backend']}: distrain ÷ torch.distributed "
    figure += f"{ratios[low]:.3f} at lowest ({low}); goal ≥ {raw['goal']}"
    figure += "" if held else " (not held: it is for NCCL between 2 or more GPUs, at full sizes)"
    return Part(label, "PASS" if ok else "FAIL", figure)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.time()
    page = harness.Page("GPU check: every strategy on NCCL, bf16 against fp32", args)
    device = page.info.get("gpu") or f"CPU ({plural(args.workers, 'worker')} in place of GPUs)"
    print(f"gpu_check: {'GPU' if args.gpus else 'CPU'} mode on {device}", flush=True)
    with harness.storage(args) as storage:
        pages = storage / "docs" if args.smoke else Path(args.out or harness.DOCS / "gpu.md").parent
        if args.smoke:
            args.out = str(pages / "gpu.md")
        parts, section = training(args, storage)
        for part in (mfu_part, collectives_part):
            began = time.time()
            parts.append(report(part(args, pages, storage), began))
        rows = [[p.name, f"**{p.status}**", p.figure.replace("|", "/"), f"{p.seconds:.0f}"] for p in parts]
        every = ["## Every part", "", *harness.table(["part", "result", "figure", "seconds"], rows, "lllr"), ""]
        links = "The benchmarks' own pages: [mfu.md](mfu.md) (MFU) and [collectives.md](collectives.md) (bandwidth)."
        page.write("\n".join([*every, *section, links]))
    failed = [p for p in parts if p.status == "FAIL"]
    counts = {s: sum(p.status == s for p in parts) for s in ("PASS", "FAIL", "SKIP")}
    print(
        f"gpu_check: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped in "
        f"{time.time() - started:.0f} s on {device}",
    )
    if not args.gpus:
        print(
            "gpu_check: CPU mode checked that the scripts work; the GPU figures (NCCL runs, bf16 on CUDA, MFU, "
            "NCCL bandwidth) are still to be taken: `make gpu-check TORCH=torch` on a GPU machine."
        )
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
