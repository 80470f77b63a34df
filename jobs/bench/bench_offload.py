"""Offload tiers (none, CPU, NVMe) side by side, and the NVMe step's disk bandwidth:  python jobs/bench/bench_offload.py

1. **Tiers.** The same job (default `llama_1b` on 2 workers, a few steps) three ways through distrain's own
   driver: `strategy=zero3` (no offload), `strategy=offload` (CPU) and `strategy=nvme`, alternating the order
   over the repeats. Per rank: the bytes of parameters, gradients and AdamW state and where each tier keeps
   them (counted as `--plan` counts them), the peak resident memory measured (VmHWM of rank 0 over the
   training steps, from metrics.jsonl: the final checkpoint comes after), and the step time. NVMe's bound:
   peak RSS ≤ CPU offload's − the moments + strategy.nvme_buffer_mb.
2. **Bandwidth.** In this process, one rank's optimizer step on --state-gib of AdamW moments: torch's AdamW
   with the moments in memory (CPU offload's step: the compute alone), NVMeAdamW with read-ahead and
   write-behind, and without (read, update, write one chunk after another); beside them the disk's raw
   sequential write and read of as many bytes, with the same calls and chunk size, in the same run. Goal: the
   overlapped step moves its bytes in ≤ 1/0.7 of the time the raw bandwidth needs for them.
Writes docs/offload.md.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import harness  # first: it keeps Ray on loopback

GOAL = 0.7  # of the raw sequential bandwidth
TIERS = {"none": ["strategy=zero3"], "cpu": ["strategy=offload"], "nvme": ["strategy=nvme"]}
STEP_KINDS = ("raw", "overlapped", "serial", "in memory")


def parse_args(argv: list[str] | None = None):
    p = harness.parser(__doc__, "docs/offload.md", repeats=2, cluster=True)
    p.add_argument("--model", default="llama_1b", help="a conf/model/*.yaml name (default llama_1b)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="steps per run (default 4; the first is left out)")
    p.add_argument("--buffer-mb", type=float, default=256.0, help="strategy.nvme_buffer_mb (default 256)")
    p.add_argument("--state-gib", type=float, default=2.0, help="AdamW state of the bandwidth part (default 2)")
    args = harness.parse(p, argv)
    if args.smoke:
        args.steps, args.state_gib = 3, 0.02
    return args


# -- 1. tiers ---------------------------------------------------------------------------------------


def run_tier(tier: str, repeat: int, args, storage: Path) -> dict:
    import shutil

    (storage / "nvme").mkdir(exist_ok=True)
    trained = harness.train(
        [
            *(harness.TINY_MODEL if args.smoke else [f"model={args.model}"]),
            *TIERS[tier],
            f"cluster.num_workers={args.workers}",
            f"trainer.max_steps={args.steps}",
            "trainer.seq_len=64",
            f"trainer.global_batch_size={args.workers}",
            "trainer.micro_batch_size=1",
            "trainer.eval_interval=0",
            "trainer.eval_batches=1",
            "checkpoint.interval=0",
            "checkpoint.async=false",  # a background save stages the whole state in host memory first
            f"strategy.nvme_path={storage / 'nvme'}",
            f"strategy.nvme_buffer_mb={args.buffer_mb}",
            f"run.storage={storage}",
            f"run.name={tier}-{repeat}",
            *harness.CPU_RUN,
        ]
    )
    if trained.error:
        raise SystemExit(f"bench_offload: {tier}: {trained.error}")
    shutil.rmtree(storage / f"{tier}-{repeat}" / "checkpoints")  # a 1B model's is 12 GB: not kept
    steps = [m for m in trained.metrics if m["step"] > 1]
    result = {
        "rss": max(m["peak_memory_bytes"] for m in steps),
        "step_s": statistics.median(m["step_time_s"] for m in steps),
        "losses": [m["loss"] for m in trained.metrics],
        "layout": trained.layout,
        "cfg": trained.cfg,
    }
    print(f"  peak RSS {result['rss'] / 2**30:.2f} GiB, {result['step_s']:.2f} s/step", flush=True)
    return result


def tier_lines(trials: list[harness.Trial], args) -> list[str]:
    from distrain.driver.plan import human, rank_memory

    runs = harness.by_key(trials)
    cfg, layout = runs["cpu"][0].result["cfg"], runs["cpu"][0].result["layout"]
    mem = rank_memory(cfg, layout, 0, "fp32")
    state = mem.params + mem.grads
    where = {
        "none": (state + mem.optimizer, 0, 0),
        "cpu": (0, state + mem.optimizer, 0),
        "nvme": (0, state + int(args.buffer_mb * 2**20), mem.optimizer),
    }
    rss = {t: [x.result["rss"] for x in runs[t]] for t in TIERS}
    step = {t: [x.result["step_s"] for x in runs[t]] for t in TIERS}
    rows = [
        [
            f"`{TIERS[t][0]}`",
            *(human(b) if b else "—" for b in where[t]),
            harness.spread([r / 2**30 for r in rss[t]]),
            harness.spread(step[t]),
        ]
        for t in TIERS
    ]
    bound = statistics.median(rss["cpu"]) - mem.optimizer + args.buffer_mb * 2**20
    nvme_rss = max(rss["nvme"])
    same = all(x.result["losses"] == runs["cpu"][0].result["losses"] for x in runs["cpu"] + runs["nvme"])
    head = ["tier", "GPU (model state)", "host", "disk", "peak RSS, rank 0 (GiB)", "step time (s)"]
    return [
        f"Model `{'tiny' if args.smoke else args.model}` ({human(mem.params * args.workers)} of fp32 parameters), "
        f"{args.workers} workers "
        f"(ZeRO-3 over them), {args.steps} steps of {args.workers} × 64 tokens, CPU (gloo), "
        f"strategy.nvme_buffer_mb={args.buffer_mb:g}, the scratch files on the local disk. Bytes per rank: "
        "parameters and gradients, and AdamW's two moments, where each tier keeps them on a GPU machine (as "
        "`--plan` counts them). On this CPU-only machine the model computes in host memory too, so the "
        "no-offload run's GPU column is host memory here: it measures as CPU offload does. Peak RSS: VmHWM of "
        "rank 0 over steps 2 onward; step time: their median. Cells: median (min–max) over the repeats.",
        "",
        *harness.table(head, rows),
        "",
        f"NVMe offload's peak RSS is {nvme_rss / 2**30:.2f} GiB against a bound of {bound / 2**30:.2f} GiB (CPU "
        f"offload's median peak − the {human(mem.optimizer)} of moments + the {args.buffer_mb:g} MiB of buffers): "
        f"{'within' if nvme_rss <= bound else 'OUTSIDE'} it, {human(statistics.median(rss['cpu']) - nvme_rss)} "
        f"below CPU offload. Losses of every CPU and NVMe run {'identical' if same else 'DIFFERENT'} step for "
        "step.",
    ]


# -- 2. bandwidth -------------------------------------------------------------------------------------


def bandwidth(args, directory: Path) -> list[harness.Trial]:
    """One rank's optimizer step, four ways (STEP_KINDS), on the same parameters and gradients."""
    import torch

    from distrain.storage import directio
    from distrain.train.nvme import NVMeAdamW, Scratch

    torch.set_num_threads(1)  # a worker's default (cluster.threads_per_worker)
    elements = int(args.state_gib * 2**30 / 8)
    params = [torch.randn(elements // 16) for _ in range(16)]  # 16 tensors: chunks cut across them
    for p in params:
        p.grad = torch.randn_like(p)
    options = {"lr": 1e-4, "weight_decay": 0.1, "foreach": True}
    optimizers = {
        "in memory": torch.optim.AdamW(params, **options),
        **{
            kind: NVMeAdamW(
                [{"params": params}], Scratch(directory, kind, int(args.buffer_mb * 2**20), kind == "overlapped")
            )
            for kind in ("overlapped", "serial")
        },
    }
    nvme = optimizers["overlapped"]
    for optimizer in optimizers.values():
        optimizer.step()  # state allocated, files written once
    state_bytes = nvme.state_bytes

    def run(kind: str, repeat: int) -> dict:
        if kind == "raw":
            return directio.sequential_bandwidth(directory, state_bytes, nvme.stream.chunk)
        start = time.perf_counter()
        optimizers[kind].step()
        return {"step_s": time.perf_counter() - start}

    trials = harness.alternate(list(STEP_KINDS), args.repeats * 2, run)
    for optimizer in optimizers.values():
        getattr(optimizer, "close", lambda: None)()
    for t in trials:
        t.result["state_bytes"], t.result["chunk"] = state_bytes, nvme.stream.chunk
    return trials


def bandwidth_lines(trials: list[harness.Trial]) -> list[str]:
    runs = harness.by_key(trials)
    size, chunk = trials[0].result["state_bytes"], trials[0].result["chunk"]
    read = statistics.median(t.result["read"] for t in runs["raw"])
    write = statistics.median(t.result["write"] for t in runs["raw"])
    raw_s = size / read + size / write  # the step's bytes at the raw speeds, one direction after the other
    step = {k: [t.result["step_s"] for t in runs[k]] for k in STEP_KINDS if k != "raw"}
    rows = [
        [k, harness.spread(v, ".3f"), harness.spread([2 * size / s / 2**30 for s in v]), ""] for k, v in step.items()
    ]
    rows[0][3] = f"{raw_s / statistics.median(step['overlapped']):.0%}"
    rows[1][3] = f"{raw_s / statistics.median(step['serial']):.0%}"
    rows.append(["raw sequential, write then read", f"{raw_s:.3f}", f"{2 * size / raw_s / 2**30:.2f}", "100%"])
    ratio = raw_s / statistics.median(step["overlapped"])
    gain = statistics.median(step["serial"]) / statistics.median(step["overlapped"])
    cost = statistics.median(step["overlapped"]) / statistics.median(step["in memory"])
    head = ["optimizer step", "seconds", "state moved (GiB/s)", "of the raw bandwidth"]
    return [
        f"One rank's AdamW step on {size / 2**30:.2f} GiB of moments ({size // 8:,} parameters in 16 tensors, one "
        f"thread), the moments streamed in chunks of {chunk / 2**20:.1f} MiB per file through 3 buffers; every "
        f"step reads and writes all of them ({2 * size / 2**30:.2f} GiB). Raw: the same bytes written, then read, "
        f"sequentially with the same calls and chunk size: write {write / 2**30:.2f} GiB/s, read "
        f"{read / 2**30:.2f} GiB/s (median). 'In memory' is torch's AdamW with the moments in host memory, CPU "
        "offload's step: the compute alone. Cells: median (min–max) over the repeats, order alternating.",
        "",
        *harness.table(head, rows),
        "",
        f"Overlapped, the step moves its bytes at {ratio:.0%} of the raw sequential bandwidth "
        f"({'meets' if ratio >= GOAL else 'misses'} the goal of ≥ {GOAL:.0%}); read-ahead and write-behind make "
        f"it {gain:.2f}× faster than one chunk after another, which pays the disk and the compute in turn. (Above "
        "100% means the disk read and wrote at once faster than it does one after the other, as the raw "
        f"reference does.) The step takes {cost:.2f}× CPU offload's, whose moments are in memory.",
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    page = harness.Page("Offload tiers: host memory, disk bandwidth, step time", args)
    with harness.storage(args) as storage:
        with harness.ray_cluster(args.address):
            tiers = harness.alternate(list(TIERS), args.repeats, lambda t, k: run_tier(t, k, args, storage))
        steps = bandwidth(args, storage)
    text = "\n".join(["## Memory tiers", "", *tier_lines(tiers, args), "", "## The disk", "", *bandwidth_lines(steps)])
    print(text)
    page.write(text, tiers + steps)


if __name__ == "__main__":
    main()
