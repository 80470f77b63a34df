"""Collective bandwidth between distrain's workers, like nccl-tests:  python jobs/bench/bench_collectives.py

Checks a cluster before training on it. The workers are started the way training starts them (distrain's
Ray layer: one worker per GPU, or a CPU share each with gloo when the cluster has no GPUs) and join the
same process group, then time broadcast, reduce, all-reduce, all-gather, reduce-scatter and send/recv
over message sizes from --min-bytes to --max-bytes, the operations' order reversed on every other repeat.
Per size it prints nccl-tests' columns: size, element count, dtype, time per operation (the max over ranks
of each rank's mean, median over the repeats), algorithm bandwidth (size / time) and bus bandwidth (algbw ×
nccl-tests' factor for the operation, comparable with the link's speed). Each pass also runs, alternating
with the workers' and on the same devices, in plain processes started as torchrun starts them (no Ray):
distrain's peak bandwidth ÷ theirs is the cost of its placement, with a goal of ≥ 0.95. Writes
docs/collectives.md and, with --json, the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import harness  # first: it keeps Ray on loopback

from distrain.testing import processes

if TYPE_CHECKING:  # torch is imported where it runs: the driver itself never needs it
    import torch

OPS = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter", "sendrecv")
DTYPES = ("float32", "bfloat16", "float16")
CPU_MAX_BYTES = 64 << 20  # keeps the default run on 2 CPU cores to a few minutes
GPU_MAX_BYTES = 256 << 20
GOAL = 0.95  # distrain's bandwidth ÷ torch.distributed's on the same devices
UNSUPPORTED = re.compile(r"not supported|unsupported|does not support|not implemented", re.IGNORECASE)

Row = dict  # {"op", "bytes", "count", "dtype", "time_us" (None: n/a), "algbw_gbps", "busbw_gbps", "note", "loads"}


def bus_factor(op: str, world: int) -> float:
    """nccl-tests' bus-bandwidth factor: the share of the data each rank's link carries, so the bus
    bandwidth of a correct ring implementation is the link's speed whatever the world size."""
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in ("all_gather", "reduce_scatter"):
        return (world - 1) / world
    return 1.0


def parse_bytes(text: str) -> int:
    """'1024', '1K', '64M', '1G' (binary multiples, as nccl-tests reads -b/-e)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 1024, 1K, 64M or 1G")
    return int(match[1]) << {"": 0, "K": 10, "M": 20, "G": 30}[match[2].upper()]


def human(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}B"
    return f"{n} B"


def sizes(lo: int, hi: int, factor: int) -> list[int]:
    out = [lo]
    while out[-1] * factor <= hi:
        out.append(out[-1] * factor)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.parser(__doc__, "docs/collectives.md", repeats=2, cluster=True)
    p.add_argument("--num-workers", type=int, default=None, help="ranks; default: every GPU, or 2 on CPUs")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU workers even when the cluster has GPUs")
    p.add_argument("--min-bytes", type=parse_bytes, default=parse_bytes("1K"), help="smallest message (default 1K)")
    p.add_argument("--max-bytes", type=parse_bytes, default=None, help="largest message; default 64M on CPU, 256M GPU")
    p.add_argument("--factor", type=int, choices=(2, 4), default=2, help="ratio between consecutive sizes (default 2)")
    p.add_argument("--iters", type=int, default=20, help="timed operations per size (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed operations per size before the timed ones")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)} (default: all)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="element type (default float32)")
    p.add_argument("--cpus-per-worker", type=float, default=0.25, help="Ray CPU share per worker (default 0.25)")
    p.add_argument("--threads-per-worker", type=int, default=1, help="torch threads per worker (default 1)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the raw numbers as JSON")
    args = harness.parse(p, argv)
    if args.smoke:
        args.max_bytes, args.iters, args.warmup, args.num_workers = 4 << 10, 2, 1, args.num_workers or 2
    args.ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = sorted(set(args.ops) - set(OPS))
    if unknown or not args.ops:
        p.error(f"--ops: unknown {', '.join(unknown) or '(none given)'}; choose from {','.join(OPS)}")
    if args.min_bytes < 1 or (args.max_bytes is not None and args.max_bytes < args.min_bytes):
        p.error("--min-bytes must be at least 1 and at most --max-bytes")
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be at least 1 and --warmup at least 0")
    if args.num_workers is not None and args.num_workers < 1:
        p.error("--num-workers must be at least 1")
    return args


# -- on every rank ----------------------------------------------------------------------------------


def bench_rank(plan: dict, channel) -> dict:
    """distrain's side, in a worker: join the group as training does, then one pass (`measure`)."""
    from distrain.parallel import process_group

    device = process_group.init_from_env()
    try:
        return measure(plan, device)
    finally:
        process_group.destroy()


def torch_rank(rank: int, world: int, port: int, plan: dict, gpu: bool, out: str) -> None:
    """torch.distributed's side, in a process started as torchrun starts one (its environment variables,
    GPU `rank` of all those visible), no Ray; the same join and pass. Rank 0 writes its result to `out`."""
    from distrain.parallel import process_group

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ.update(MASTER_PORT=str(port), OMP_NUM_THREADS=str(plan["threads"]))
    device = process_group.init_from_env(gpu=gpu)
    try:
        result = measure(plan, device)
    finally:
        process_group.destroy()
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def measure(plan: dict, device: torch.device) -> dict:
    """One pass over the operations, in plan["ops"]' order; rank 0 returns the rows (each with the load
    before its operation) and every rank's device, the others {}."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for op in plan["ops"]:
        before = os.getloadavg()[0]  # harness.load(), without importing harness (and Ray) into the worker
        rows += [{**row, "load": before} for row in time_sizes(op, plan, getattr(torch, plan["dtype"]), device)]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    devices: list = [None] * world
    dist.all_gather_object(devices, f"{os.uname().nodename}: {name}")
    return {"rows": rows, "devices": devices} if rank == 0 else {}


def time_sizes(op: str, plan: dict, dtype: torch.dtype, device: torch.device) -> list[Row]:
    """One operation at every size: a row each, its time the max over ranks (None: n/a, with a note)."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    itemsize = torch.empty((), dtype=dtype).element_size()
    rows: list[Row] = []
    note = None  # why the op is n/a, once it is
    for size in plan["sizes"]:
        count = size // itemsize
        if op in ("all_gather", "reduce_scatter"):
            count -= count % world  # the large buffer splits evenly over the ranks
        row = {"op": op, "bytes": count * itemsize, "count": count, "dtype": plan["dtype"], "time_us": None}
        if count == 0:
            row["note"] = f"below one {plan['dtype']} per rank"
        elif op == "sendrecv" and world == 1:
            row["note"] = note = "needs 2 ranks"
        elif note is None:
            call, buffers = make_op(op, count, dtype, device, rank, world)
            note = probe(op, call, buffers, device, rank, world)
            if note is None:
                seconds = time_op(call, plan["warmup"], plan["iters"], device)
                worst = torch.tensor([seconds], dtype=torch.float64, device=device)
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                row["time_us"] = worst.item() * 1e6
            del call, buffers
        row.setdefault("note", note)
        rows.append(row)
    return rows


Buffers = dict  # "in" (where present) and "out" of one operation


def make_op(
    op: str, count: int, dtype: torch.dtype, device: torch.device, rank: int, world: int
) -> tuple[Callable[[], None], Buffers]:
    """The operation on fresh buffers filled with rank + 1 (for `probe`'s check). In place where the
    collective allows it (broadcast, reduce, all-reduce); all-gather and reduce-scatter go between one
    buffer of `count` elements and one of count / world, like nccl-tests' out-of-place runs."""
    import torch
    import torch.distributed as dist

    from distrain.compat import all_gather_single as all_gather
    from distrain.compat import reduce_scatter_single as reduce_scatter

    def filled(n: int) -> torch.Tensor:
        return torch.full((n,), float(rank + 1), dtype=dtype, device=device)

    if op in ("broadcast", "reduce", "all_reduce"):
        buf = filled(count)
        if op == "broadcast":
            return (lambda: dist.broadcast(buf, src=0)), {"out": buf}
        if op == "reduce":
            return (lambda: dist.reduce(buf, dst=0)), {"out": buf}
        return (lambda: dist.all_reduce(buf)), {"out": buf}
    if op == "all_gather":
        inp, out = filled(count // world), torch.empty(count, dtype=dtype, device=device)
        return (lambda: all_gather(out, inp)), {"in": inp, "out": out}
    if op == "reduce_scatter":
        inp, out = filled(count), torch.empty(count // world, dtype=dtype, device=device)
        return (lambda: reduce_scatter(out, inp)), {"in": inp, "out": out}
    if op == "sendrecv":
        send, recv = filled(count), torch.zeros(count, dtype=dtype, device=device)
        ring = [
            dist.P2POp(dist.isend, send, (rank + 1) % world),
            dist.P2POp(dist.irecv, recv, (rank - 1) % world),
        ]

        def sendrecv() -> None:  # every rank sends to the next while receiving from the previous
            for work in dist.batch_isend_irecv(ring):
                work.wait()

        return sendrecv, {"in": send, "out": recv}
    raise ValueError(op)


def expected(op: str, rank: int, world: int, numel: int) -> torch.Tensor | None:
    """What `out` holds after one operation on inputs filled with rank + 1 (None: unspecified)."""
    import torch

    total = world * (world + 1) / 2
    if op == "broadcast":
        return torch.ones(numel)
    if op in ("all_reduce", "reduce_scatter"):
        return torch.full((numel,), total)
    if op == "reduce":
        return torch.full((numel,), total) if rank == 0 else None
    if op == "all_gather":
        return torch.arange(1, world + 1, dtype=torch.float64).repeat_interleave(numel // world)
    if op == "sendrecv":
        return torch.full((numel,), float((rank - 1) % world + 1))
    raise ValueError(op)


OK, UNSUPPORTED_HERE, WRONG = 2, 1, 0  # a rank's probe outcome; the group acts on the worst


def probe(
    op: str, call: Callable[[], None], buffers: Buffers, device: torch.device, rank: int, world: int
) -> str | None:
    """Run the operation once and check its result; return why it is n/a (the backend lacks it for this
    dtype or device) or None. Every rank learns the worst outcome over ranks, so all skip it or all fail
    together instead of the others waiting for a peer that never comes."""
    import torch
    import torch.distributed as dist

    note, outcome = None, OK
    try:
        call()
    except (RuntimeError, NotImplementedError, ValueError) as e:
        if not UNSUPPORTED.search(str(e)):
            raise
        note, outcome = f"unsupported: {str(e).strip().splitlines()[0][:120]}", UNSUPPORTED_HERE
    if outcome == OK:
        want = expected(op, rank, world, buffers["out"].numel())
        if want is not None and not torch.allclose(buffers["out"].double().cpu(), want.double(), rtol=1e-2):
            outcome = WRONG
    worst = torch.tensor([outcome], device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MIN)
    if worst.item() == WRONG:
        raise RuntimeError(f"{op} of {buffers['out'].numel()} elements gave a wrong result on some rank")
    if worst.item() == UNSUPPORTED_HERE:
        return note or "unsupported on another rank"
    for buf in buffers.values():
        buf.zero_()  # repeated in-place sums of zeros never overflow, whatever --iters
    return None


def time_op(call: Callable[[], None], warmup: int, iters: int, device: torch.device) -> float:
    """Mean seconds per operation on this rank: CUDA events around the launched loop on a GPU (the
    launches queue up, as in nccl-tests), wall-clock time on a CPU, where gloo's calls return when
    their operation is done. A barrier first, so every rank starts the timed loop together."""
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        dist.barrier()
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    dist.barrier()
    began = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - began) / iters


# -- on the driver ----------------------------------------------------------------------------------


def one_pass(side: str, repeat: int, group, plan: dict, gpu: bool) -> dict:
    """One pass of one side, the operations' order reversed on every other repeat: rank 0's result."""
    import torch.multiprocessing as mp

    plan = {**plan, "ops": plan["ops"] if repeat % 2 else plan["ops"][::-1]}
    if side == "distrain":
        return group.run(bench_rank, plan)[0]
    with tempfile.TemporaryDirectory(prefix="bench_collectives_") as tmp:
        out = Path(tmp, "rank0.json")
        try:
            mp.spawn(torch_rank, args=(plan["world"], processes.free_port(), plan, gpu, str(out)), nprocs=plan["world"])
        except mp.ProcessExitedException:
            if not out.exists():  # else a rank died on its way out, its pass done (gloo can abort at exit)
                raise
        return json.loads(out.read_text())


def merge(passes: list[harness.Trial], ops: list[str], world: int) -> list[Row]:
    """One side's rows, op by op in `ops`' order: each time the median over the passes, with the load
    before each pass's run of the operation."""
    rows = []
    for op in ops:
        each = [[r for r in t.result["rows"] if r["op"] == op] for t in passes]
        for same in zip(*each, strict=True):
            row = {k: v for k, v in same[0].items() if k != "load"}
            row |= {"time_us": harness.median_of([r["time_us"] for r in same]), "loads": [r["load"] for r in same]}
            rows.append(finish_row(row, world))
    return rows


def ratios(ours: list[Row], theirs: list[Row]) -> dict[str, float]:
    """Per operation run on both sides: distrain's peak bandwidth ÷ torch.distributed's (of algbw: the same
    ratio as busbw's, whose factor both sides share, and defined on one rank, where busbw is 0)."""

    def peak(rows: list[Row], op: str) -> float | None:
        return max((r["algbw_gbps"] for r in rows if r["op"] == op and r["algbw_gbps"]), default=None)

    out = {}
    for op in dict.fromkeys(r["op"] for r in ours):
        a, b = peak(ours, op), peak(theirs, op)
        if a and b:
            out[op] = a / b
    return out


def finish_row(row: Row, world: int) -> Row:
    if row["time_us"] is None:
        return {**row, "algbw_gbps": None, "busbw_gbps": None}
    algbw = row["bytes"] / (row["time_us"] * 1e-6) / 1e9
    return {**row, "algbw_gbps": algbw, "busbw_gbps": algbw * bus_factor(row["op"], world)}


CONSOLE = "{:>12} {:>12} {:>9} {:>12} {:>10} {:>10}  {}"


def console(rows: list[Row]) -> str:
    """The rows as nccl-tests prints them, an op at a time."""
    lines = []
    for op in dict.fromkeys(r["op"] for r in rows):
        lines += ["", f"# {op}", CONSOLE.format("size(B)", "count", "type", "time(us)", "algbw", "busbw", "").rstrip()]
        lines.append(CONSOLE.format("", "(elements)", "", "", "(GB/s)", "(GB/s)", "").rstrip())
        for r in (r for r in rows if r["op"] == op):
            if r["time_us"] is None:
                lines.append(CONSOLE.format(r["bytes"], r["count"], r["dtype"], "n/a", "n/a", "n/a", r["note"] or ""))
                continue
            cells = [f"{r['time_us']:.1f}", f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}"]
            lines.append(CONSOLE.format(r["bytes"], r["count"], r["dtype"], *cells, "").rstrip())
    return "\n".join(lines)


def summary(rows: list[Row]) -> dict[str, dict]:
    """Per op: the peak busbw (what large messages get) and the lowest time (the latency floor that
    small messages pay), the two numbers a reader checks first."""
    out: dict[str, dict] = {}
    for r in rows:
        if r["time_us"] is None:
            continue
        s = out.setdefault(r["op"], {"peak_busbw_gbps": -1.0, "min_time_us": float("inf")})
        if r["busbw_gbps"] > s["peak_busbw_gbps"]:
            s["peak_busbw_gbps"], s["peak_at_bytes"] = r["busbw_gbps"], r["bytes"]
        if r["time_us"] < s["min_time_us"]:
            s["min_time_us"], s["min_at_bytes"] = r["time_us"], r["bytes"]
    return out


def reading(rows: list[Row], world: int, backend: str) -> str:
    """What the numbers say, from the numbers."""
    table = summary(rows)
    if not table:
        return "No operation ran: every one is n/a here."
    best = max(table, key=lambda op: table[op]["peak_busbw_gbps"])
    fastest = min(table, key=lambda op: table[op]["min_time_us"])
    text = (
        f"The highest bus bandwidth is {best}'s, {table[best]['peak_busbw_gbps']:.3f} GB/s at "
        f"{human(table[best]['peak_at_bytes'])}; the lowest time per operation {fastest}'s, "
        f"{table[fastest]['min_time_us']:,.1f} µs at {human(table[fastest]['min_at_bytes'])}: what every small "
        "message pays, whatever its size."
    )
    if world == 1:
        return text + (
            " With one rank nothing crosses a link: nccl-tests' bus-bandwidth factor is 0 for all-reduce, "
            "all-gather and reduce-scatter, and broadcast's and reduce's figures are the size over a call that "
            "moves nothing. The times are each call's floor on this device; bandwidth needs two or more ranks."
        )
    if {"all_reduce", "all_gather", "reduce_scatter"} <= set(table):
        ar, parts = table["all_reduce"]["peak_busbw_gbps"], [table[op]["peak_busbw_gbps"] for op in OPS[3:5]]
        text += (
            f" All-reduce's peak busbw is {ar / statistics.fmean(parts):.2f}× the mean of all-gather's and "
            "reduce-scatter's: near 1 when all-reduce is implemented as the two (a ring), as nccl-tests' factors "
            "assume."
        )
    if backend == "gloo":
        text += (
            f" These are {world} gloo ranks on one machine's CPU cores: each operation is memory copies and "
            "loopback TCP sockets, run by the same cores that compute, so the figures measure that software path "
            "(and the load on the machine), not a network."
        )
    return text


def comparison(args: argparse.Namespace, world: int, ours: list[Row], theirs: list[Row]) -> list[str]:
    """The page's section on distrain's workers against plain torch.distributed processes."""
    mine, base, ratio = summary(ours), summary(theirs), ratios(ours, theirs)
    cells = [
        [op, f"{mine[op]['peak_busbw_gbps']:.3f}", f"{base[op]['peak_busbw_gbps']:.3f}", f"{ratio[op]:.3f}"]
        if op in ratio
        else [op, "n/a", "n/a", "n/a"]
        for op in args.ops
    ]
    head = ["operation", "distrain: peak busbw (GB/s)", "torch.distributed: peak busbw (GB/s)", "ratio"]
    lines = [
        "## Against torch.distributed without Ray",
        "",
        "Each pass ran on both sides, which one went first alternating from pass to pass: in distrain's workers,",
        f"and in {world} plain processes started as torchrun starts them (`torch.multiprocessing`, torchrun's",
        "environment variables, GPU *i* for rank *i*), which join with the same `init_from_env` and time the",
        "same code, without Ray.",
        "What differs is how the processes were started and placed: Ray's worker processes, the devices and",
        "CPU share each is given. **ratio**: distrain's peak bandwidth over the sizes ÷ torch.distributed's",
        f"(the busbw factor is the same on both sides); the goal is ≥ {GOAL}.",
        "",
        *harness.table(head, cells),
        "",
    ]
    if ratio:
        op = min(ratio, key=ratio.get)
        verdict = "meets" if ratio[op] >= GOAL else "falls short of"
        lines.append(f"The lowest ratio, {op}'s {ratio[op]:.3f}, {verdict} the goal of ≥ {GOAL}.")
    if world == 1:
        lines.append("On one rank busbw is 0 and nothing crosses a link: the ratio compares local copies only.")
    return [*lines, ""]


def body(args: argparse.Namespace, run: dict, rows: list[Row], theirs: list[Row] | None) -> str:
    world, hosts = run["world_size"], sorted({d.split(": ", 1)[0] for d in run["ranks"]})
    alone = "" if theirs else "; with --address the workers may be on other machines: no torch.distributed baseline"
    lines = [
        "Bandwidth of torch.distributed collectives between distrain's workers, reported the way",
        "[nccl-tests](https://github.com/NVIDIA/nccl-tests) reports it, so a cluster can be checked before",
        "training on it. `jobs/bench/bench_collectives.py` starts the workers through distrain's own Ray layer",
        "(`WorkerGroup`: one worker per GPU with NCCL, or a CPU share each with gloo) and each rank joins the",
        "process group with `init_from_env`, exactly as training does.",
        "",
        f"- {world} rank(s) on {len(hosts)} node(s) ({', '.join(sorted(set(run['ranks'])))}), {run['backend']}, "
        f"{args.dtype}; {args.warmup} warm-up and {args.iters} timed operations per size; sizes "
        f"{human(args.min_bytes)}–{human(args.max_bytes)} in steps of ×{args.factor}; "
        f"{args.threads_per_worker} torch thread(s) per worker; {args.repeats} pass(es) over the operations, "
        f"the order reversed on every other one. The whole run took {run['wall_s']:.0f} s, Ray's start "
        f"included{alone}.",
        "- **time**: each rank's mean time per operation (CUDA events around the loop on GPUs; wall clock",
        "  after a barrier on CPUs, where gloo's calls return when done), the max over ranks, the median over",
        "  the passes. **load**: the 1-minute load average before each pass of the operation.",
        "- **size** is the larger buffer, as in nccl-tests: all-gather's output and reduce-scatter's input",
        "  (each rank contributes or keeps size ÷ ranks); **count** is its number of elements.",
        "- **algbw** = size ÷ time (GB/s = 10⁹ B/s); **busbw** = algbw × nccl-tests' factor: all-reduce",
        "  2(n−1)/n, all-gather and reduce-scatter (n−1)/n, broadcast, reduce and send/recv 1. busbw is",
        "  comparable across world sizes and with the speed of the links themselves.",
        "- broadcast, reduce and all-reduce run in place; send/recv is a ring (each rank sends to the next",
        "  and receives from the previous at once). Each operation's result is checked once before timing.",
        "- **n/a**: the backend does not implement the operation for this dtype or device; the benchmark",
        "  says so and goes on rather than failing.",
        "",
        "## Summary",
        "",
    ]
    table = summary(rows)
    cells = []
    for op in args.ops:
        s = table.get(op)
        loads = ", ".join(f"{x:.2f}" for x in next(r["loads"] for r in rows if r["op"] == op))
        if s is None:
            cells.append([op, "n/a", "", "n/a", "", loads])
            continue
        cells.append(
            [op, f"{s['peak_busbw_gbps']:.3f}", human(s["peak_at_bytes"])]
            + [f"{s['min_time_us']:,.1f}", human(s["min_at_bytes"]), loads]
        )
    head = ["operation", "peak busbw (GB/s)", "at size", "lowest time (µs)", "at size", "load"]
    lines += [*harness.table(head, cells), "", *(comparison(args, world, rows, theirs) if theirs else [])]
    lines += ["## Reading", "", reading(rows, world, run["backend"]), ""]
    for op in args.ops:
        mine = [r for r in rows if r["op"] == op]
        out = []
        for r in mine:
            timed = ["n/a"] * 3
            if r["time_us"] is not None:
                timed = [f"{r['time_us']:,.1f}", f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}"]
            out.append([human(r["bytes"]), r["bytes"], r["count"], r["dtype"], *timed])
        head = ["size", "size (B)", "count", "type", "time (µs)", "algbw (GB/s)", "busbw (GB/s)"]
        notes = sorted({r["note"] for r in mine if r.get("note")})
        lines += [f"## {op} (busbw factor {bus_factor(op, world):.3g})", "", *harness.table(head, out, "rrrlrrr")]
        lines += ["", *(f"n/a: {n}" for n in notes), *([""] if notes else [])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import ray

    from distrain.cluster.placement import GroupSpec, PlacementError, WorkerFailure
    from distrain.cluster.runtime import CapacityError, check_capacity, gpu_count
    from distrain.cluster.worker_group import WorkerGroup

    page = harness.Page("Collectives", args)
    started = time.time()
    sides = {"distrain": "distrain's workers"}
    if args.address is None:  # the baseline runs here: only an embedded cluster's workers share its devices
        sides["torch"] = "torch.distributed, plain processes"
    try:
        with harness.ray_cluster(args.address):
            use_gpu = gpu_count() > 0 and not args.cpu
            if args.num_workers is None:
                args.num_workers = int(ray.cluster_resources().get("GPU", 0)) if use_gpu else 2
            if args.max_bytes is None:
                args.max_bytes = max(args.min_bytes, GPU_MAX_BYTES if use_gpu else CPU_MAX_BYTES)
            spec = GroupSpec(
                num_workers=args.num_workers,
                cpus_per_worker=args.cpus_per_worker,
                gpus_per_worker=1 if use_gpu else 0,
                threads_per_worker=args.threads_per_worker,
            )
            check_capacity(spec.num_workers, spec.cpus_per_worker, spec.gpus_per_worker)
            backend = "nccl" if use_gpu else "gloo"
            if args.num_workers == 1:
                print("bench_collectives: 1 rank: the collectives move no data and send/recv is n/a", file=sys.stderr)
            plan = {
                "ops": args.ops,
                "sizes": sizes(args.min_bytes, args.max_bytes, args.factor),
                "dtype": args.dtype,
                "iters": args.iters,
                "warmup": args.warmup,
                "world": args.num_workers,
                "threads": args.threads_per_worker,
            }
            print(
                f"bench_collectives: {args.num_workers} rank(s), {backend}, {args.dtype}, "
                f"{human(args.min_bytes)}..{human(args.max_bytes)} ×{args.factor}, "
                f"{args.warmup}+{args.iters} operations per size, {args.repeats} pass(es) of {' and '.join(sides)}, "
                f"ops {','.join(args.ops)}",
                flush=True,
            )
            with WorkerGroup(spec) as group:
                group.start()
                trials = harness.alternate(
                    list(sides), args.repeats, lambda side, k: one_pass(side, k, group, plan, use_gpu), sides.get
                )
    except (CapacityError, PlacementError, WorkerFailure) as e:
        raise SystemExit(f"bench_collectives: error: {e}") from None
    passes = harness.by_key(trials)
    rows = merge(passes["distrain"], args.ops, args.num_workers)
    theirs = merge(passes["torch"], args.ops, args.num_workers) if "torch" in passes else None
    run = {"backend": backend, "world_size": args.num_workers, "ranks": passes["distrain"][0].result["devices"]}
    run["wall_s"] = time.time() - started
    print(console(rows))
    print(f"\nbench_collectives: done in {run['wall_s']:.0f}s")
    for op, s in summary(rows).items():
        print(
            f"  {op:15s} peak busbw {s['peak_busbw_gbps']:.3f} GB/s at {human(s['peak_at_bytes'])}; "
            f"lowest time {s['min_time_us']:.1f} µs at {human(s['min_at_bytes'])}"
        )
    ratio = ratios(rows, theirs) if theirs else {}
    if ratio:
        each = ", ".join(f"{op} {r:.3f}" for op, r in ratio.items())
        print(f"bench_collectives: distrain ÷ torch.distributed, peak bandwidth: {each} (goal ≥ {GOAL})")
    page.write(body(args, run, rows, theirs))
    if args.json:
        raw = {"command": args.command, "run": run, "settings": vars(args), "rows": rows, "torch_rows": theirs}
        raw |= {"ratios": ratio, "goal": GOAL}
        Path(args.json).write_text(json.dumps(raw, indent=1, default=str) + "\n")
        print(f"bench_collectives: wrote {args.json}")


if __name__ == "__main__":
    main()
