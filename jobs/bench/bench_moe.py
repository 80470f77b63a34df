"""Mixture of experts beside the dense model of the same active parameters:  python jobs/bench/bench_moe.py

1. Step time and tokens/s of `model=moe_nano` (8 experts of 192, top-2) at ep 1, 2 and 4 beside `model=nano`
   (an MLP of 384: as many weights per token) on 4 workers, through `distrain.driver.launch.train` on one Ray
   cluster, the runs alternated (ABBA) and repeated; ratios to nano.
2. The all-to-all share of the step at ep 2 and 4: 4 gloo ranks (no Ray) laid out by `ParallelModel` as a
   worker lays them out, the wall time inside every `torch.distributed.all_to_all_single` (the exchange's calls,
   forward and backward) over the step's.
3. Balancing: `moe_imbalance_<block>` (busiest expert's tokens ÷ the mean) at every step for balance=aux_loss,
   bias and none on the same seed and data.

Writes docs/moe.md and its plot (docs/moe.svg; its numbers docs/moe.json: `--replot` redraws it).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import harness  # first: it keeps Ray on loopback
import torch
import torch.distributed as dist

from distrain.config import ModelConfig, OptimConfig, StrategyConfig
from distrain.driver.cli import compose
from distrain.model.registry import build_model
from distrain.parallel.parallelize import ParallelModel
from distrain.strategy.resolve import layout_of
from distrain.testing import processes
from distrain.train.learner import cross_entropy
from distrain.train.optim import build_optimizer

MODES = ("aux_loss", "bias", "none")
COLOURS = {"aux_loss": "#1f77b4", "bias": "#2ca02c", "none": "#d62728"}
SMOKE_SIZE = [*harness.TINY, "model.moe.expert_dim=32"]  # tiny: 2 experts × 32 = the dense ffn of 64


def overrides(model: str, ep: int, workers: int, steps: int, name: str, storage: Path, smoke: bool) -> list[str]:
    """One run through the product path: DDP over `workers`, the experts split over `ep` of them."""
    run = [f"run.storage={storage}", f"run.name={name}", f"trainer.max_steps={steps}"]
    quiet = ["checkpoint.interval=0", "trainer.eval_interval=0", "trainer.eval_batches=1", "cluster.reuse_workers=true"]
    layout = [f"model={model}", "strategy=ddp", f"strategy.ep={ep}", f"cluster.num_workers={workers}"]
    return [*layout, *(SMOKE_SIZE if smoke else []), *run, *quiet, *harness.CPU_RUN]


def trained(cmd: list[str]) -> harness.Trained:
    done = harness.train(cmd)
    if done.error:
        raise SystemExit(f"bench_moe: {' '.join(cmd[:3])}: {done.error}")
    return done


# -- 1. step time -------------------------------------------------------------------------------


def timed_run(key: tuple[str, int], repeat: int, args, storage: Path) -> dict:
    """The median of the trainer's own `step_time_s` after the warm-up, and the last loss."""
    model, ep = key
    run = trained(overrides(model, ep, args.workers, args.steps, f"{model}-ep{ep}-{repeat}", storage, args.smoke))
    step, t = statistics.median(m["step_time_s"] for m in run.metrics if m["step"] > args.warmup), run.cfg.trainer
    print(f"  step {step:.3f}s", flush=True)
    return {"step_s": step, "tokens": t.global_batch_size * t.seq_len, "loss": run.metrics[-1]["loss"]}


def step_rows(trials: list[harness.Trial]) -> list[dict]:
    """Per configuration: each repeat's step, its ratio to the dense run of the same repeat, and the least step
    (other processes only ever add time)."""
    by_key = harness.by_key(trials)
    dense = [t.result["step_s"] for t in by_key[("nano", 1)]]
    rows = []
    for (model, ep), mine in by_key.items():
        passes = [t.result["step_s"] for t in mine]
        rows.append(
            {"model": model, "ep": ep, "passes": passes, "loads": [t.load for t in mine], "step_s": min(passes)}
            | {"ratios": [p / d for p, d in zip(passes, dense, strict=True)], "ratio": min(passes) / min(dense)}
            | {"tokens_per_s": mine[0].result["tokens"] / min(passes), "loss": mine[-1].result["loss"]}
        )
    return rows


def step_table(rows: list[dict]) -> list[str]:
    head = ["model", "ep", "step (s)", "tokens/s", "step ÷ nano", "each repeat's ÷ nano", "each pass (s)"]
    cells = [
        [f"{r['model']}", r["ep"], f"{r['step_s']:.3f}", f"{r['tokens_per_s']:,.0f}", f"**{r['ratio']:.2f}**"]
        + [", ".join(f"{x:.2f}" for x in r["ratios"]), ", ".join(f"{p:.3f}" for p in r["passes"])]
        + [", ".join(f"{x:.2f}" for x in r["loads"]), f"{r['loss']:.3f}"]
        for r in rows
    ]
    return harness.table([*head, "load before each pass", "last loss"], cells, "lrrrrrrrr")


# -- 2. the all-to-all share ----------------------------------------------------------------------


@contextlib.contextmanager
def all_to_all_clock() -> Iterator[dict]:
    """While entered, the calls to `torch.distributed.all_to_all_single` and the wall time spent in them (each
    returns once its rows have arrived: a synchronous call). Expert parallelism's exchange calls it through the
    module, forward and backward, so timing the function times the exchange's traffic, the wait for the slowest
    rank included, and leaves what it computes alone."""
    clock, original = {"calls": 0, "s": 0.0}, dist.all_to_all_single

    def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202  (all_to_all_single's own)
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            clock["s"] += time.perf_counter() - started
            clock["calls"] += 1

    dist.all_to_all_single = timed
    try:
        yield clock
    finally:
        dist.all_to_all_single = original


def share_rank(
    rank: int, device: torch.device, model: ModelConfig, eps: list, rows: int, seq: int, micro: int, steps: int
) -> dict:
    """One rank, for each ep: a training step unmeasured, then `steps` timed, with the all-to-alls inside them."""
    world, out = dist.get_world_size(), {}
    tokens = torch.randint(0, model.vocab_size, (rows, seq + 1), generator=torch.Generator().manual_seed(rank))
    for ep in eps:
        with torch.device("meta"):
            net = build_model(model, seq, seed=0)
        layout = layout_of(dp_replicate=world, ep=ep, micro_batches=micro)
        parallel = ParallelModel(net, StrategyConfig(dp_replicate=world, ep=ep), layout, device, False, cross_entropy)
        optimizer = build_optimizer(parallel.module, OptimConfig())

        def step(parallel: ParallelModel = parallel, optimizer: torch.optim.Optimizer = optimizer) -> None:
            parallel.forward_backward(tokens[:, :-1], tokens[:, 1:])
            parallel.clip_grad_norm(1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()
        with all_to_all_clock() as clock:
            started = time.perf_counter()
            for _ in range(steps):
                step()
            elapsed = time.perf_counter() - started
        out[ep] = {"step_s": elapsed / steps, "a2a_s": clock["s"] / steps, "calls": clock["calls"] / steps}
        del parallel, optimizer
    return out


def share_table(ranks: list[dict]) -> tuple[list[str], dict]:
    rows, shares = [], {}
    for ep in ranks[0]:
        each = [r[ep]["a2a_s"] / r[ep]["step_s"] for r in ranks]
        shares[int(ep)] = statistics.mean(each)
        step, a2a = (statistics.mean(r[ep][k] for r in ranks) for k in ("step_s", "a2a_s"))
        calls, share = f"{ranks[0][ep]['calls']:.0f}", f"**{shares[int(ep)]:.0%}**"
        rows.append([f"ep {ep}", calls, f"{step:.3f}", f"{a2a:.3f}", share, f"{min(each):.0%}–{max(each):.0%}"])
    head = ["layout", "all-to-alls per step", "step (s)", "in all-to-alls (s)", "share", "share per rank"]
    return harness.table(head, rows), shares


# -- 3. balancing ---------------------------------------------------------------------------------


def curves(args, storage: Path) -> dict:
    """Per mode, `moe_imbalance_<block>` at every step of one run, ep 1, the same seed and data."""
    data = {"steps": [], "modes": {}, "loss": {}}
    for mode in MODES:
        cmd = overrides("moe_nano", 1, args.workers, args.balance_steps, f"balance-{mode}", storage, args.smoke)
        run = trained([*cmd, f"model.moe.balance={mode}", "trainer.log_interval=1"])
        blocks = [k for k in run.metrics[0] if k.startswith("moe_imbalance_")]
        lines = [m for m in run.metrics if blocks[0] in m]
        data["steps"] = [m["step"] for m in lines]
        data["modes"][mode] = {k.removeprefix("moe_imbalance_"): [m[k] for m in lines] for k in blocks}
        data["loss"][mode] = run.metrics[-1]["loss"]
    return data


def mean_curve(by_block: dict) -> list[float]:
    return [statistics.mean(v) for v in zip(*by_block.values(), strict=True)]


def draw(data: dict):  # noqa: ANN201  (a matplotlib Figure)
    """Imbalance against step: per mode the mean over the blocks, bold, and each block's, faint."""
    from plots import figure  # jobs/bench/plots.py: matplotlib, only where a plot is drawn

    fig, ax = figure(7.6, 4.0)
    for mode, by_block in data["modes"].items():
        for values in by_block.values():
            ax.plot(data["steps"], values, color=COLOURS[mode], lw=0.6, alpha=0.3)
        ax.plot(data["steps"], mean_curve(by_block), color=COLOURS[mode], lw=1.8, label=f"balance={mode}")
    ax.axhline(1.0, color="#888", linestyle="--", linewidth=1, label="even load")
    ax.set_title("Load imbalance per step: busiest expert's tokens ÷ the mean", loc="left")
    ax.set_xlabel("step")
    ax.set_ylabel("max ÷ mean tokens per expert")
    ax.set_xlim(left=0)
    ax.legend(frameon=False)
    return fig


def balance_table(data: dict, tail: int) -> list[str]:
    rows = []
    for mode, by_block in data["modes"].items():
        mean = mean_curve(by_block)
        blocks = ", ".join(f"{b}: {v[0]:.2f} → {v[-1]:.2f}" for b, v in by_block.items())
        rows.append([mode, f"{mean[0]:.2f}", f"{mean[-1]:.2f}", f"{statistics.mean(mean[-tail:]):.2f}", blocks])
        rows[-1].append(f"{data['loss'][mode]:.3f}")
    head = ["balance", "first step", "last step", f"mean of the last {tail}", "each block, first → last", "last loss"]
    return harness.table(head, rows, "lrrrlr")


# -- the page -------------------------------------------------------------------------------------


def body(args, rows: list[dict], share: tuple[list[str], dict], data: dict, plot: str) -> str:
    from distrain.model.size import flops_per_token, num_params

    size = SMOKE_SIZE if args.smoke else []
    moe, dense = (compose([f"model={m}", *size]) for m in ("moe_nano", "nano"))
    t, m = moe.trainer, moe.model.moe
    flops = [flops_per_token(c.model, t.seq_len) / 1e6 for c in (moe, dense)]
    by = {(r["model"], r["ep"]): r for r in rows}
    ep_cost = {ep: 1 - by["moe_nano", 1]["step_s"] / by["moe_nano", ep]["step_s"] for _, ep in by if ep > 1}
    lines, shares = share
    tail = min(10, len(data["steps"]))
    return "\n".join(
        [
            f"`moe_nano`: {num_params(moe.model):,} parameters, {m.num_experts} experts of {m.expert_dim} a block, "
            f"top-{m.top_k}; `nano`: {num_params(dense.model):,} parameters, an MLP of {dense.model.ffn_dim}. A token "
            f"passes through as many weights in both: {flops[0]:.3f} against {flops[1]:.3f} MFLOPs per token (the "
            "router's the difference). fp32, AdamW, DDP, gloo on 127.0.0.1, every worker one thread.",
            "",
            "Not measured here: 1-D tensor parallelism, under which every rank of a tensor-parallel group routes the "
            "same tokens through whole experts (tp× the routed experts' FLOPs; "
            "[parallelism.md](parallelism.md#the-strategies)).",
            "",
            "## 1. Step time beside the dense model",
            "",
            f"Each configuration through `distrain.driver.launch.train` on one Ray cluster ({args.workers} workers, "
            f"`cluster.reuse_workers=true`), global batch {t.global_batch_size} × {t.seq_len} tokens, micro-batch "
            f"{t.micro_batch_size}; {args.repeats} repeat(s) of {args.steps} steps, the order reversed on every other "
            f"repeat (ABBA). A pass's step is the median of the trainer's `step_time_s` over steps {args.warmup + 1}–"
            f"{args.steps}; the table's is the least pass (other processes only add time), and 'step ÷ nano' divides "
            "it by nano's least; each repeat's ratio divides that repeat's passes. One run of nano before them is not "
            "counted: a fresh cluster's first run steps slower (Ray still starting processes beside it). The load "
            "before each run is in the header and the table: another's work on the cores slows every configuration "
            "of a repeat alike.",
            "",
            *step_table(rows),
            "",
            "## 2. The all-to-all share of the step",
            "",
            f"{args.workers} gloo ranks on this machine (`distrain.testing.processes.spawn_ranks`, no Ray), each laid "
            "out by `ParallelModel` as a worker lays it out (DDP, the experts split over ep ranks), the same model and "
            f"per-rank batch as above, random tokens; one step unmeasured, then {args.share_steps} timed (forward, "
            "backward, clipping, AdamW). The time inside `torch.distributed.all_to_all_single`, which "
            "`distrain/parallel/expert_parallel.py`'s `exchange` and `AllToAll` call (per MoE layer and micro-batch: "
            "the counts, the rows out and back in the forward, the two gradients' in the backward), is summed by a "
            "wrapper around the function that times each call and changes nothing it computes; a call returns once "
            "its rows have arrived, so the time includes waiting for the slowest rank. Share: that time over the "
            "step's, the mean of the ranks'.",
            "",
            *lines,
            "",
            "Megatron reports 30–40% of the step in unoptimised all-to-all, on GPUs; here it is "
            + ", ".join(f"{s:.0%} at ep {ep}" for ep, s in shares.items())
            + ". Section 1 gives a second, coarser estimate through the product path: the share of the ep step that "
            "ep 1 (no exchange, every expert on every rank, the same FLOPs) does not take: "
            + (", ".join(f"{c:.0%} at ep {ep}" for ep, c in ep_cost.items()) or "—")
            + ". The two differ: a rank that waits in an all-to-all for a slower peer would, without the exchange, "
            "wait as long in DDP's gradient all-reduce, so the first counts that wait and the second does not. On CPUs "
            "the exchange is a copy through loopback sockets that needs a core, and the "
            f"{args.workers} single-threaded ranks share the machine's cores, so a rank waiting in an all-to-all "
            "also waits for a descheduled peer; "
            "on GPUs with NCCL the compute is far faster and the exchange crosses NVLink or the network instead.",
            "",
            "## 3. Balancing",
            "",
            f"`moe_nano` at ep 1 for {len(data['steps'])} steps with `model.moe.balance` aux_loss (weight "
            f"{m.aux_loss_weight}), bias (rate {m.bias_rate}) and none, the same seed and data (the standard library's "
            "source, bytes). `moe_imbalance_<block>` from metrics.jsonl: the busiest expert's token copies ÷ the "
            f"mean over the whole batch, 1 for an even load, at most {m.num_experts // m.top_k} (every token's "
            f"{m.top_k} copies on {m.top_k} experts). Bold: the mean over the blocks; faint: each block.",
            "",
            f"![load imbalance per step]({plot})",
            "",
            *balance_table(data, tail),
        ]
    )


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, "docs/moe.md", repeats=3, plot=True, cluster=True)
    p.add_argument("--workers", type=int, default=4, help="workers of the runs, ranks of the all-to-all share")
    p.add_argument("--steps", type=int, default=20, help="training steps per timed run")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the step time")
    p.add_argument("--balance-steps", type=int, default=200, help="training steps per balancing run")
    p.add_argument("--share-steps", type=int, default=5, help="timed steps on the gloo ranks")
    args = harness.parse(p, argv)
    if harness.replot(args, draw):
        return
    if args.smoke:
        args.workers, args.steps, args.warmup, args.balance_steps, args.share_steps = 2, 3, 1, 3, 1
    eps = [ep for ep in (1, 2, 4) if ep <= args.workers]
    page = harness.Page("Mixture of experts: step time, all-to-all share, balancing", args)
    cfg = compose(["model=moe_nano", *(SMOKE_SIZE if args.smoke else [])])
    rows, t = cfg.trainer.global_batch_size // args.workers, cfg.trainer
    print(f"bench_moe: the all-to-all share at ep {eps[1:]} on {args.workers} gloo ranks ...", flush=True)
    ranks = processes.spawn_ranks(
        share_rank, args.workers, cfg.model, eps[1:], rows, t.seq_len, rows // t.micro_batch_size, args.share_steps
    )
    share = share_table(ranks)
    print("\n".join(share[0]), flush=True)
    keys = [("nano", 1)] + [("moe_nano", ep) for ep in eps]
    with harness.storage(args) as storage, harness.ray_cluster(args.address):
        print("bench_moe: one run unmeasured: a fresh cluster's first run steps slower", flush=True)
        timed_run(keys[0], 0, args, storage)
        trials = harness.alternate(
            keys, args.repeats, lambda key, k: timed_run(key, k, args, storage), lambda key: f"{key[0]} ep {key[1]}"
        )
        data = curves(args, storage)
    rows = step_rows(trials)
    print("\n".join(step_table(rows)), flush=True)
    page.write(body(args, rows, share, data, page.plot), trials, plot=(draw, data))


if __name__ == "__main__":
    main()
