"""Memory per rank and step time of every strategy, side by side:  python jobs/bench/bench_strategies.py

1. Memory per rank of ZeRO-0/1/2/3 and CPU offload on gloo processes (no Ray), counted from the tensors
   by `distrain.parallel.memory.state_bytes` and set beside ZeRO's arithmetic.
2. The step time of each strategy preset through the product path, `distrain.driver.launch.train` on one
   embedded Ray cluster, on the same model, batch and worker count, the presets' order reversed on every
   other repeat.

Writes docs/strategies.md. The pipeline schedules' bubble is jobs/bench/bench_bubble.py's (docs/bubble.md).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import harness  # first: it keeps Ray on loopback
import torch

from distrain.config import ModelConfig, OptimConfig, StrategyConfig
from distrain.driver.cli import compose
from distrain.model.llama import Transformer
from distrain.model.size import num_params
from distrain.parallel.memory import state_bytes
from distrain.parallel.parallelize import ParallelModel
from distrain.strategy.layout import Layout
from distrain.strategy.resolve import layout_of
from distrain.testing import processes
from distrain.train.learner import cross_entropy
from distrain.train.optim import build_optimizer, local_optimizer

ADAMW_STATES = 2  # exp_avg and exp_avg_sq, each the size of the parameters
MEMORY_CASES = {**{f"zero{z}": (z, "none") for z in range(4)}, "offload": (3, "cpu")}  # (zero, offload)
STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "hsdp", "offload", "tp", "pp", "fsdp_tp"]
OVERSUBSCRIBED = {"3d": 8}  # presets that need more workers than --workers: run with this many, and labelled
KINDS = ("params", "grads", "optimizer")


def model(smoke: bool) -> ModelConfig:
    """conf/model/nano.yaml, or the smoke run's tiny model."""
    return compose(["model=nano", *(harness.TINY_MODEL if smoke else [])]).model


# -- 1. memory ----------------------------------------------------------------------------------


def memory_rank(rank: int, device: torch.device, world: int, cfg: ModelConfig, seq_len: int) -> dict:
    """One rank: one training step under each case; its bytes of state."""
    results = {}
    for name, (zero, offload) in MEMORY_CASES.items():
        net = Transformer(cfg, seq_len, seed=0)
        replicate, shard = (1, world) if zero else (world, 1)
        strategy = StrategyConfig(zero=zero, offload=offload, dp_replicate=replicate, dp_shard=shard)
        layout = layout_of(dp_replicate=replicate, dp_shard=shard, micro_batches=2)
        parallel = ParallelModel(net, strategy, layout, device, False, cross_entropy)
        optimizer = build_optimizer(parallel.module, OptimConfig(), parallel.zero1_group)
        batch = torch.randint(0, cfg.vocab_size, (2, seq_len))

        def step(  # the loop's values bound now, not at the loop's end
            parallel: ParallelModel = parallel,
            optimizer: torch.optim.Optimizer = optimizer,
            batch: torch.Tensor = batch,
        ) -> None:
            parallel.forward_backward(batch, batch)
            optimizer.step()

        results[name] = state_bytes(parallel.module, local_optimizer(optimizer), step)
    return results


def measure_memory(world: int, cfg: ModelConfig, seq_len: int) -> dict[str, dict[str, list[int]]]:
    """case → kind → bytes on each rank."""
    ranks = processes.spawn_ranks(memory_rank, world, world, cfg, seq_len)
    return {case: {k: [r[case][k] for r in ranks] for k in KINDS} for case in MEMORY_CASES}


def memory_theory(case: str, params: int, world: int) -> list[float]:
    """Bytes per rank of params, grads and optimizer state: P, P, K·P (P = params in fp32), each
    divided by the rank count from the ZeRO level that shards it (optimizer 1, grads 2, params 3)."""
    p, zero = params * 4, MEMORY_CASES[case][0]
    full = {3: p, 2: p, 1: ADAMW_STATES * p}
    return [b / (world if zero >= level else 1) for level, b in full.items()]


def memory_table(measured: dict[str, dict[str, list[int]]], params: int, world: int) -> list[str]:
    """Per case and kind: the largest rank's bytes (what must fit), theory, and measured/theory over the ranks."""
    rows = []
    for case, kinds in measured.items():
        theory = memory_theory(case, params, world)
        cells = [f"{max(kinds[k]) / 2**20:.3f} / {t / 2**20:.3f}" for k, t in zip(KINDS, theory, strict=True)]
        total = max(sum(kinds[k][r] for k in KINDS) for r in range(world))
        cells.append(f"{total / 2**20:.3f} / {sum(theory) / 2**20:.3f}")
        ratios = []
        for k, t in zip(KINDS, theory, strict=True):
            lo, hi = min(kinds[k]) / t, max(kinds[k]) / t
            ratios.append(f"{hi:.4f}" if f"{lo:.4f}" == f"{hi:.4f}" else f"{lo:.4f}–{hi:.4f}")
        rows.append([case, *cells, ", ".join(ratios)])
    head = ["case", "params (MiB): measured / theory", "grads (MiB)", "optimizer state (MiB)", "total (MiB)"]
    return harness.table([*head, "measured ÷ theory: params, grads, optimizer"], rows, "lrrrrl")


def memory_reading(measured: dict[str, dict[str, list[int]]], params: int, world: int) -> str:
    worst = max(
        (abs(b / theory - 1), case, kind)
        for case, kinds in measured.items()
        for kind, theory in zip(KINDS, memory_theory(case, params, world), strict=True)
        for b in kinds[kind]
    )
    total = {case: max(sum(k[r] for k in kinds.values()) for r in range(world)) for case, kinds in measured.items()}
    theory = {case: sum(memory_theory(case, params, world)) for case in measured}
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


# -- 2. step time -------------------------------------------------------------------------------


def describe_layout(layout: Layout, s: StrategyConfig) -> str:
    """The mesh a config resolved to, e.g. 'dp_replicate 2 × tp 2', with its ZeRO level."""
    parts = [" × ".join(f"{name} {size}" for name, size in layout.sizes().items() if size > 1)]
    parts += [f"ZeRO-{s.zero}"] if s.zero else []
    parts += ["offload"] if s.offload != "none" else []
    parts += [layout.schedule] if layout.pp > 1 else []
    return ", ".join(parts)


def run_strategy(name: str, workers: int, repeat: int, args, storage: Path) -> dict:
    """Train preset `name` for args.steps; its layout and the median of the trainer's own `step_time_s`
    over the steps after the warm-up. Workers are kept between runs of the same shape (their start is
    not what this measures)."""
    run = [f"run.storage={storage}", f"run.name={name}-{workers}-{repeat}", f"trainer.max_steps={args.steps}"]
    quiet = ["checkpoint.interval=0", "trainer.eval_interval=0", "trainer.eval_batches=1", "cluster.reuse_workers=true"]
    size = harness.TINY if args.smoke else []
    trained = harness.train(
        ["model=nano", f"strategy={name}", f"cluster.num_workers={workers}", *size, *run, *quiet, *harness.CPU_RUN]
    )
    if trained.error:
        raise SystemExit(f"bench_strategies: {name} on {workers} workers: {trained.error}")
    steps = [m["step_time_s"] for m in trained.metrics if m["step"] > args.warmup]
    t = trained.cfg.trainer
    print(f"  step {statistics.median(steps):.3f}s", flush=True)
    return {
        "layout": describe_layout(trained.layout, trained.cfg.strategy),
        "micro_batches": trained.layout.micro_batches,
        "batch": (t.global_batch_size, t.seq_len, t.micro_batch_size),
        "step_s": statistics.median(steps),
    }


def step_rows(trials: list[harness.Trial]) -> list[dict]:
    """Per preset: its layout, each run's median step in pass order, and the least of them (other
    processes only ever add time, as `timeit` takes the minimum)."""
    rows = []
    for (name, workers), mine in harness.by_key(trials).items():
        passes = [t.result["step_s"] for t in mine]
        first = mine[0].result
        rows.append(
            {**first, "strategy": name, "workers": workers, "passes": passes, "loads": [t.load for t in mine]}
            | {"step_s": min(passes), "tokens_per_s": first["batch"][0] * first["batch"][1] / min(passes)}
        )
    return rows


def step_table(rows: list[dict], world: int) -> list[str]:
    ddp = next(r["step_s"] for r in rows if r["strategy"] == "ddp" and r["workers"] == world)
    head = ["strategy", "workers", "layout", "micro-batches per rank", "step time (s)", "tokens/s", "step time / ddp"]
    cells = [
        [
            r["strategy"] + (" (oversubscribed)" if r["workers"] > world else ""),
            r["workers"],
            r["layout"],
            r["micro_batches"],
            f"{r['step_s']:.3f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['step_s'] / ddp:.2f}",
            ", ".join(f"{p:.3f}" for p in r["passes"]),
            ", ".join(f"{x:.2f}" for x in r["loads"]),
        ]
        for r in rows
    ]
    return harness.table([*head, "each pass (s)", "load before each pass"], cells, "lrlrrrrrr")


def step_reading(rows: list[dict], world: int) -> str:
    ddp = next(r["step_s"] for r in rows if r["strategy"] == "ddp")
    ranked = sorted((r for r in rows if r["workers"] == world), key=lambda r: r["step_s"])
    order = ", ".join(f"{r['strategy']} {r['step_s'] / ddp:.2f}" for r in ranked)
    cores = harness.machine()["cores"]
    return (
        f"Fastest first, relative to ddp: {order}. These are CPU/gloo numbers on {cores} cores ({world} "
        "single-threaded workers share them): the workers' compute does not all run in parallel, and every "
        "collective is a copy through loopback sockets that needs a core too. So the table ranks the strategies by "
        "how much and how often they communicate, not by how they perform on GPUs with NCCL, where communication "
        "overlaps compute. DDP all-reduces the gradients once per step, in buckets; ZeRO-1 adds a broadcast of the "
        "updated parameters; FSDP (ZeRO-2/3, HSDP) all-gathers parameters and reduce-scatters gradients block by "
        "block, ZeRO-3 gathering again for the backward; offload is ZeRO-3 plus the offload policy's moves, which "
        "on a CPU save nothing; TP all-gathers and reduce-scatters activations in every block, forward and "
        "backward; PP sends activations between its stages and all-reduces its share of the gradients over the "
        "replicas, and its bubble ([bubble.md](bubble.md)) costs little here, since an idle rank's core goes to "
        "another worker."
    )


# -- the page -----------------------------------------------------------------------------------


def body(args, cfg: ModelConfig, memory: dict, rows: list[dict]) -> str:
    params, world = num_params(cfg), args.workers
    batch, seq, micro = rows[0]["batch"]
    oversubscribed = [f"{name} needs {n} workers" for name, n in args.oversubscribed.items()]
    return "\n".join(
        [
            "## 1. Memory per rank",
            "",
            f"Model `{cfg.name}` ({params:,} parameters: P = {params * 4 / 2**20:.3f} MiB in fp32) on {world} ranks "
            "(gloo processes on 127.0.0.1, no Ray), AdamW (K = 2 states per parameter), one training step per "
            "case. `distrain.parallel.memory.state_bytes` counts each rank's tensors (a DTensor its local shard): "
            "parameters as held when the forward pass ends, gradients before the optimizer step, optimizer state "
            f"after it. Theory per rank, N = {world}: ZeRO-0 P, P, KP; ZeRO-1 P, P, KP/N; ZeRO-2 P, P/N, KP/N; "
            "ZeRO-3 and offload P/N, P/N, KP/N. Cells give the largest rank; the last column the range over the "
            "ranks.",
            "",
            *memory_table(memory, params, world),
            "",
            memory_reading(memory, params, world),
            "",
            "## 2. Step time per strategy",
            "",
            "Each preset through `distrain.driver.launch.train`, the product's own path (one embedded Ray cluster on "
            "loopback, started once; workers with `cluster.cpus_per_worker=0.25` and one thread each, kept warm "
            f"between runs of the same shape with `cluster.reuse_workers=true`): model `{cfg.name}`, {world} "
            f"workers, global batch {batch} × {seq} tokens, micro-batch {micro}, fp32, AdamW; {args.repeats} run(s) "
            f"of {args.steps} steps per preset, the order reversed on every other pass; each run's median of the "
            f"trainer's own `step_time_s` over steps {args.warmup + 1}–{args.steps} is in the 'each pass' column, "
            "and step time is the least of them (other processes on the machine only add time); tokens/s = "
            f"{batch * seq:,} / step time. Where TP or PP take workers, fewer are left for data parallelism, so "
            "each data-parallel rank runs more micro-batches of the same global batch. "
            + (
                ", ".join(oversubscribed) + " and runs with them, labelled oversubscribed; its ratio is still to "
                f"ddp on {world}."
                if oversubscribed
                else ""
            ),
            "",
            *step_table(rows, world),
            "",
            step_reading(rows, world),
            "",
            "The pipeline schedules' idle time against theory is measured apart: [bubble.md](bubble.md).",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, "docs/strategies.md", repeats=2, cluster=True)
    p.add_argument("--workers", type=int, default=4, help="ranks of the memory table, workers of the step times")
    p.add_argument("--steps", type=int, default=20, help="training steps per run of a strategy")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the step time")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="presets to time (3d is added, on 8 workers)")
    args = harness.parse(p, argv)
    args.strategies, args.oversubscribed = args.strategies.split(","), OVERSUBSCRIBED
    if args.smoke:
        args.workers, args.steps, args.warmup, args.strategies, args.oversubscribed = 2, 4, 1, ["ddp", "zero2"], {}
    page = harness.Page("Strategies: memory per rank and step time", args)
    cfg = model(args.smoke)
    memory = measure_memory(args.workers, cfg, 32 if args.smoke else 64)
    print("\n".join(memory_table(memory, num_params(cfg), args.workers)), flush=True)

    plan = [(name, args.workers) for name in args.strategies] + list(args.oversubscribed.items())
    with harness.storage(args) as storage, harness.ray_cluster(args.address):
        trials = harness.alternate(
            plan, args.repeats, lambda key, k: run_strategy(*key, k, args, storage), lambda key: f"{key[0]} ×{key[1]}"
        )
    rows = step_rows(trials)
    print("\n".join(step_table(rows, args.workers)), flush=True)
    page.write(body(args, cfg, memory, rows), trials)


if __name__ == "__main__":
    main()
