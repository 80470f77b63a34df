"""Every strategy side by side, in one invocation:  python jobs/bench_strategies.py [--quick]

1. Memory per rank of ZeRO-0/1/2/3 and CPU offload on 4 gloo processes (no Ray), counted from the
   tensors by `distrain.parallel.memory.state_bytes` and set beside ZeRO's arithmetic.
2. The pipeline bubble of each schedule against theory (jobs/bench_bubble.py) and its plot.
3. The step time of each strategy preset through the product path, `distrain.launch.train` on an
   embedded Ray cluster, on the same model, batch and worker count.

It prints each table and writes them, with the command, machine and date, to docs/strategies.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_bubble import BubbleSetup, join_group, measure_bubble, spawn, svg
from bench_bubble import section as bubble_section
from bench_bubble import table as bubble_table
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from machine import describe, machine, off_loopback  # jobs/machine.py, beside this script
from omegaconf import OmegaConf

from distrain.config import ModelConfig, OptimConfig, StrategyConfig, TrainConfig
from distrain.layout import MeshSizes
from distrain.model.llama import Transformer
from distrain.parallel import process_group
from distrain.parallel.memory import state_bytes
from distrain.parallel.parallelize import ParallelModel
from distrain.tracking import read_metrics
from distrain.train.loop import cross_entropy
from distrain.train.optim import build_optimizer, local_optimizer

ROOT = Path(__file__).resolve().parent.parent
WORLD = 4  # ranks of the memory table, workers of the step-time table
ADAMW_STATES = 2  # exp_avg and exp_avg_sq, each the size of the parameters
MEMORY_CASES = {"zero0": (0, False), "zero1": (1, False), "zero2": (2, False), "zero3": (3, False)}  # (zero, offload)
MEMORY_CASES["offload"] = (3, True)
STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "hsdp", "offload", "tp", "pp", "fsdp_tp"]
OVERSUBSCRIBED = {"3d": 8}  # presets that need more workers than WORLD: run with this many, and labelled
KINDS = ("params", "grads", "optimizer")
# The tests' CPU settings (gloo, fp32, no W&B), no checkpoint or validation but the final ones, quiet progress.
CPU_RUN = ["cluster.use_gpu=false", "trainer.precision=fp32", "logger.wandb.mode=disabled", "checkpoint.interval=0"]
CPU_RUN += ["trainer.eval_interval=0", "trainer.eval_batches=1", "logger.progress_interval_s=600"]


def nano() -> ModelConfig:
    """The model preset itself, conf/model/nano.yaml, on top of the schema's defaults."""
    preset = OmegaConf.load(ROOT / "conf" / "model" / "nano.yaml")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), preset))


# -- 1. memory ----------------------------------------------------------------------------------


def memory_rank(rank: int, port: int, out: str, seq_len: int) -> None:
    """One rank: one training step of nano under each case; its bytes of state to a file."""
    device = join_group(rank, WORLD, port)
    results = {}
    for name, (zero, offload) in MEMORY_CASES.items():
        torch.manual_seed(0)
        model = Transformer(nano(), seq_len)
        replicate, shard = (1, WORLD) if zero else (WORLD, 1)
        strategy = StrategyConfig(zero=zero, offload=offload, dp_replicate=replicate, dp_shard=shard)
        parallel = ParallelModel(model, strategy, MeshSizes(1, replicate, shard, 1), device, False, 1, cross_entropy)
        optimizer = build_optimizer(parallel.module, OptimConfig(), parallel.zero1_group)
        batch = torch.randint(0, model.cfg.vocab_size, (2, seq_len))

        def step(  # the loop's values bound now, not at the loop's end
            parallel: ParallelModel = parallel,
            optimizer: torch.optim.Optimizer = optimizer,
            batch: torch.Tensor = batch,
        ) -> None:
            parallel.forward_backward(batch, batch, 2)
            optimizer.step()

        results[name] = state_bytes(parallel.module, local_optimizer(optimizer), step)
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    process_group.destroy()


def measure_memory(seq_len: int) -> tuple[dict[str, dict[str, list[int]]], int]:
    """case → kind → bytes on each rank, and the model's parameter count."""
    ranks = spawn(memory_rank, WORLD, seq_len)
    params = sum(p.numel() for p in Transformer(nano(), seq_len).parameters())
    return {case: {k: [r[case][k] for r in ranks] for k in KINDS} for case in MEMORY_CASES}, params


def memory_theory(case: str, params: int) -> list[float]:
    """Bytes per rank of params, grads and optimizer state: P, P, K·P (P = params in fp32), each
    divided by the rank count from the ZeRO level that shards it (optimizer 1, grads 2, params 3)."""
    p, zero = params * 4, MEMORY_CASES[case][0]
    full = {3: p, 2: p, 1: ADAMW_STATES * p}
    return [b / (WORLD if zero >= level else 1) for level, b in full.items()]


def memory_table(measured: dict[str, dict[str, list[int]]], params: int) -> list[str]:
    """Per case and kind: the largest rank's bytes (what must fit), theory, and measured/theory over the ranks."""
    rows = [
        "| case | params (MiB): measured / theory | grads (MiB) | optimizer state (MiB) | total (MiB) "
        "| measured ÷ theory: params, grads, optimizer |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for case, kinds in measured.items():
        theory = memory_theory(case, params)
        cells = [f"{max(kinds[k]) / 2**20:.3f} / {t / 2**20:.3f}" for k, t in zip(KINDS, theory, strict=True)]
        total = max(sum(kinds[k][r] for k in KINDS) for r in range(WORLD))
        cells.append(f"{total / 2**20:.3f} / {sum(theory) / 2**20:.3f}")
        ratios = []
        for k, t in zip(KINDS, theory, strict=True):
            lo, hi = min(kinds[k]) / t, max(kinds[k]) / t
            ratios.append(f"{hi:.4f}" if f"{lo:.4f}" == f"{hi:.4f}" else f"{lo:.4f}–{hi:.4f}")
        rows.append(f"| {case} | " + " | ".join(cells) + " | " + ", ".join(ratios) + " |")
    return rows


# -- 3. step time -------------------------------------------------------------------------------


def compose(overrides: list[str]) -> TrainConfig:
    """The config `python jobs/train.py overrides...` would train."""
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return OmegaConf.to_object(hydra_compose("train", overrides=overrides))


def layout(cfg: TrainConfig) -> str:
    """The mesh a validated config resolved to, e.g. 'dp_replicate 2 × tp 2', with its ZeRO level."""
    s = cfg.strategy
    sizes = {name: getattr(s, name) for name in ("pp", "dp_replicate", "dp_shard", "tp")}
    parts = [" × ".join(f"{name} {size}" for name, size in sizes.items() if size > 1)]
    parts += [f"ZeRO-{s.zero}"] if s.zero else []
    parts += ["offload"] if s.offload else []
    parts += [s.schedule] if s.pp > 1 else []
    return ", ".join(parts)


def run_strategy(name: str, workers: int, args: argparse.Namespace, run_dir: Path) -> tuple[dict, list[float]]:
    """Train preset `name` for args.steps through distrain.launch.train; its layout and the trainer's own
    `step_time_s` of each step after the warm-up."""
    from distrain.launch import train  # here: Ray stays out of the spawned ranks of parts 1 and 2

    run = [f"run.storage={run_dir.parent}", f"run.name={run_dir.name}", f"trainer.max_steps={args.steps}"]
    cfg = compose(["model=nano", f"strategy={name}", f"cluster.num_workers={workers}", *run, *CPU_RUN])
    train(cfg)  # validates cfg in place: the layout's open sizes are filled in
    placement = json.loads(Path(cfg.run_dir, "placement.json").read_text())
    if off := off_loopback(placement):
        raise SystemExit(f"bench_strategies: workers ran off loopback: {off}")
    t, s = cfg.trainer, cfg.strategy
    info = {
        "strategy": name,
        "workers": workers,
        "layout": layout(cfg),
        "micro_batches": t.global_batch_size // (t.micro_batch_size * s.dp_replicate * s.dp_shard),
        "batch": (t.global_batch_size, t.seq_len, t.micro_batch_size),
    }
    return info, [m["step_time_s"] for m in read_metrics(cfg.run_dir) if m["step"] > args.warmup]


def measure_steps(args: argparse.Namespace) -> list[dict]:
    """Every preset, args.repeats times, the order reversed on every other pass so that a spell of load from
    other processes falls on different presets; per preset the median step of each run, and the least of
    those (other processes only ever add time, as `timeit` takes the minimum)."""
    # An embedded cluster, started once and reused by every run, on loopback: Ray reads this variable when
    # first imported (distrain's connect sets it only after importing Ray), else it binds the external NIC.
    os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    os.environ.pop("RAY_ADDRESS", None)
    import ray

    plan = [(name, WORLD) for name in STRATEGIES] + list(OVERSUBSCRIBED.items())
    runs: dict[tuple[str, int], tuple[dict, list[float]]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench_strategies_") as storage:
            for repeat in range(args.repeats):
                for name, workers in plan if repeat % 2 == 0 else plan[::-1]:
                    info, steps = run_strategy(name, workers, args, Path(storage, f"{name}-{workers}-{repeat}"))
                    median = statistics.median(steps)
                    runs.setdefault((name, workers), (info, []))[1].append(median)  # in pass order
                    print(f"{name} ×{workers} (pass {repeat + 1}): step {median:.3f}s", flush=True)
    finally:
        ray.shutdown()
    results = []
    for info, passes in (runs[key] for key in plan):
        tokens = info["batch"][0] * info["batch"][1]
        results.append({**info, "passes": passes, "step_s": min(passes), "tokens_per_s": tokens / min(passes)})
    return results


def step_table(results: list[dict]) -> list[str]:
    ddp = next(r["step_s"] for r in results if r["strategy"] == "ddp" and r["workers"] == WORLD)
    rows = [
        "| strategy | workers | layout | micro-batches per rank | step time (s) | tokens/s | step time / ddp "
        "| each pass (s) |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        label = r["strategy"] + (" (oversubscribed)" if r["workers"] > WORLD else "")
        rows.append(
            f"| {label} | {r['workers']} | {r['layout']} | {r['micro_batches']} | {r['step_s']:.3f} "
            f"| {r['tokens_per_s']:,.0f} | {r['step_s'] / ddp:.2f} | {', '.join(f'{p:.3f}' for p in r['passes'])} |"
        )
    return rows


# -- the report ---------------------------------------------------------------------------------


def memory_reading(measured: dict[str, dict[str, list[int]]], params: int) -> str:
    worst = max(
        (abs(b / theory - 1), case, kind)
        for case, kinds in measured.items()
        for kind, theory in zip(KINDS, memory_theory(case, params), strict=True)
        for b in kinds[kind]
    )
    total = {case: max(sum(k[r] for k in kinds.values()) for r in range(WORLD)) for case, kinds in measured.items()}
    theory = {case: sum(memory_theory(case, params)) for case in measured}
    share = {
        case: (total[case] / total["zero0"], theory[case] / theory["zero0"]) for case in ("zero1", "zero2", "zero3")
    }
    uneven = [case for case, kinds in measured.items() if any(len(set(v)) > 1 for v in kinds.values())]
    return (
        f"Every amount on every rank is within {worst[0]:.2%} of theory (furthest: {worst[1]} {worst[2]}). Per "
        "rank, "
        + ", ".join(f"{c} holds {m:.3f} of zero0's bytes (theory {t:.3f})" for c, (m, t) in share.items())
        + f". Ranks differ only under {', '.join(uneven) or 'none'}: ZeRO-1's ZeroRedundancyOptimizer gives each "
        "rank whole parameters, FSDP2 (ZeRO-2/3) splits every tensor on dim 0. Offload holds ZeRO-3's bytes, but "
        "FSDP2's CPUOffloadPolicy keeps them in host memory and steps the optimizer there: on a GPU that moves all "
        "of them off the device; on this CPU-only machine host memory is the only memory, so offload saves "
        "nothing here."
    )


def step_reading(results: list[dict]) -> str:
    ddp = next(r["step_s"] for r in results if r["strategy"] == "ddp")
    ranked = sorted((r for r in results if r["workers"] == WORLD), key=lambda r: r["step_s"])
    order = ", ".join(f"{r['strategy']} {r['step_s'] / ddp:.2f}" for r in ranked)
    return (
        f"Fastest first, relative to ddp: {order}. These are CPU/gloo numbers on an oversubscribed 2-core machine "
        f"({WORLD} single-threaded workers share 2 cores): the workers' compute does not run in parallel, and every "
        "collective is a copy through loopback sockets that needs a core too. So the table ranks the strategies by "
        "how much and how often they communicate, not by how they perform on GPUs with NCCL, where communication "
        "overlaps compute. DDP all-reduces the gradients once per step, in buckets; ZeRO-1 adds a broadcast of the "
        "updated parameters; FSDP (ZeRO-2/3, HSDP) all-gathers parameters and reduce-scatters gradients block by "
        "block, ZeRO-3 gathering again for the backward; offload is ZeRO-3 plus the offload policy's moves, which "
        "on a CPU save nothing; TP all-gathers and reduce-scatters activations in every block, forward and "
        "backward; PP sends activations between its 2 stages and all-reduces half of the gradients over 2 "
        "replicas, and its bubble costs little here, since an idle rank's core goes to another worker."
    )


def markdown(args: argparse.Namespace, info: dict, sections: dict) -> str:
    memory, params = sections["memory"]
    bubble, setup = sections["bubble"]
    steps = sections["steps"]
    batch, seq, micro = steps[0]["batch"]
    loads = ", ".join(f"{part} {load:.2f}" for part, load in sections["load"].items())
    return "\n".join(
        [
            "# Strategies: memory, pipeline bubble, step time",
            "",
            "```bash",
            args.command,
            "```",
            "",
            f"- Date: {time.strftime('%Y-%m-%d %H:%M %Z')}.",
            f"- Machine: {describe(info)}.",
            f"- 1-minute load average at the start of each part: {loads} (the machine is shared; other "
            "processes on its 2 cores slow the runs down and add noise, most to the step times).",
            "",
            "## 1. Memory per rank",
            "",
            f"Model `nano` ({params:,} parameters: P = {params * 4 / 2**20:.3f} MiB in fp32) on {WORLD} ranks "
            "(gloo processes on 127.0.0.1, no Ray), AdamW (K = 2 states per parameter), one training step per "
            "case. `distrain.parallel.memory.state_bytes` counts each rank's tensors (a DTensor its local shard): "
            "parameters as held when the forward pass ends, gradients before the optimizer step, optimizer state "
            "after it. Theory per rank, N = 4: ZeRO-0 P, P, KP; ZeRO-1 P, P, KP/N; ZeRO-2 P, P/N, KP/N; ZeRO-3 and "
            "offload P/N, P/N, KP/N. Cells give the largest rank; the last column the range over the ranks.",
            "",
            *memory_table(memory, params),
            "",
            memory_reading(memory, params),
            "",
            "## 2. Pipeline bubble",
            "",
            *bubble_section(bubble, setup, os.path.relpath(ROOT / args.svg, (ROOT / args.out).parent)),
            "",
            "## 3. Step time per strategy",
            "",
            "Each preset through `distrain.launch.train`, the product's own path (one embedded Ray cluster on "
            "loopback, started once; workers with `cluster.cpus_per_worker=0.25` and one thread each): model "
            f"`nano`, {WORLD} workers, global batch {batch} × {seq} tokens, micro-batch {micro}, fp32, AdamW; "
            f"{args.repeats} run(s) of {args.steps} steps per preset, the order reversed on every other pass; each "
            f"run's median of the trainer's own `step_time_s` over steps {args.warmup + 1}–{args.steps} is in the "
            "last column, and step time is the least of them (other processes on the machine only add time); "
            f"tokens/s = {batch * seq:,} / step time. Where TP or PP take workers, fewer are left for data "
            "parallelism, so each data-parallel rank runs more micro-batches of the same global batch. "
            + ", ".join(f"{name} needs {n} workers" for name, n in OVERSUBSCRIBED.items())
            + " and runs with them, labelled oversubscribed (8 processes on 2 cores); its ratio is still to "
            f"ddp on {WORLD}.",
            "",
            *step_table(steps),
            "",
            step_reading(steps),
            "",
        ]
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller bubble model, fewer steps: a few minutes")
    p.add_argument("--steps", type=int, help="training steps per run of a strategy (default 20, quick 8)")
    p.add_argument("--repeats", type=int, help="runs of each strategy, in alternating order (default 2, quick 1)")
    p.add_argument("--bubble-pp", type=int, default=2, help="pipeline ranks of the bubble measurement")
    p.add_argument("--out", default="docs/strategies.md", help="markdown to write ('' for none)")
    p.add_argument("--svg", default="docs/bubble.svg", help="bubble plot, beside the markdown")
    args = p.parse_args()
    args.steps = args.steps or (8 if args.quick else 20)
    args.repeats = args.repeats or (1 if args.quick else 2)
    args.warmup = 3 if args.quick else 5
    exe = os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT)) else sys.executable
    args.command = shlex.join([exe, "jobs/bench_strategies.py", *sys.argv[1:]])
    return args


def main() -> None:
    args = parse_args()
    info = machine()
    load: dict[str, float] = {}
    load["memory"] = os.getloadavg()[0]
    memory, params = measure_memory(seq_len=64)
    print("\n".join(memory_table(memory, params)), flush=True)

    setup = BubbleSetup(pp=args.bubble_pp)
    if args.quick:
        setup = BubbleSetup(pp=args.bubble_pp, micro_batches=[2, 4, 8], dim=128, n_layers=8, steps=3)
    load["bubble"] = os.getloadavg()[0]
    bubble = measure_bubble(setup)
    print("\n".join(bubble_table(bubble, setup)), flush=True)

    load["step time"] = os.getloadavg()[0]
    steps = measure_steps(args)
    print("\n".join(step_table(steps)), flush=True)

    if args.out:
        sections = {"memory": (memory, params), "bubble": (bubble, setup), "steps": steps, "load": load}
        Path(ROOT, args.out).write_text(markdown(args, info, sections))
        Path(ROOT, args.svg).write_text(svg(bubble, setup))
        print(f"wrote {args.out} and {args.svg}")


if __name__ == "__main__":
    main()
