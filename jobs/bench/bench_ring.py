"""Ring attention's blocks on one GPU against sdpa on the whole sequence:  python jobs/bench/bench_ring.py

What the cp ranks of ring attention compute (distrain/parallel/ring_attention.py's blocks, each by the fused
kernel sdpa picks, and their merges; distrain/testing/ring.py), rank after rank on one GPU without the
exchanges, against F.scaled_dot_product_attention (causal) on the whole sequence, at 16k, 32k and 64k tokens in
bf16: the forward and backward time of all the ranks' blocks together (the same arithmetic as the whole's), the
most memory one rank's blocks add to what it holds against what the whole's kernel adds, and the largest error of
the output and the gradients against the whole's (relative to the largest value). Each length is timed
--repeats times, the ring and the whole alternating; the medians are reported. It passes when the errors are
within bf16's rounding, TOLERANCE (the ring rounds each block's output before its fp32 merge); the time and
memory are reported. Needs a GPU: without one it says so and exits 0, writing no page; --smoke runs short
sequences on the CPU in fp32, to check that it works (jobs/gpu_check.py's ring part in CPU mode).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import harness  # first: it keeps Ray on loopback (nothing here starts Ray)
import torch
import torch.nn.functional as F

from distrain.testing.ring import rank_backward, rank_forward, ring, split

LENGTHS, HEADS, HEAD_DIM, CP = [16384, 32768, 65536], 16, 128, 4
SMOKE = ([256, 512], 4, 16)  # lengths, heads, head size
TOLERANCE = 2**-7  # the errors, relative to the largest value
MIB = 2**20


def sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def timed(device: torch.device, fn, *args) -> tuple[float, object]:
    began = sync(device)
    got = fn(*args)
    return sync(device) - began, got


def whole(q, k, v, dout) -> tuple:
    """sdpa on the whole sequence: (forward s, backward s, output, dq, dk, dv)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    fwd, out = timed(q.device, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    bwd, _ = timed(q.device, out.backward, dout)
    return fwd, bwd, out.detach(), q.grad, k.grad, v.grad


def ring_timed(q, k, v, dout, cp: int) -> tuple[float, float]:
    """The ranks' blocks: (forward s, backward s), all ranks together."""
    _, mine = split(q, k, v, dout, cp)
    fwd, merged = timed(q.device, lambda: [rank_forward(mine, r) for r in range(cp)])
    grads = [[torch.zeros_like(t, dtype=torch.float32) for t in m[:3]] for m in mine]
    bwd, _ = timed(q.device, lambda: [rank_backward(mine, r, merged[r], grads) for r in range(cp)])
    return fwd, bwd


def peak(device: torch.device, fn) -> float:
    """MiB the call adds at its most to what was allocated before it (CUDA; 0 on the CPU)."""
    if device.type != "cuda":
        fn()
        return 0.0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / MIB


def one_rank(mine: list, cp: int) -> None:
    """Rank 0's forward and backward (its grads as the ring keeps them: its dq and the travelling dk, dv)."""
    merged = rank_forward(mine, 0)
    grads = [[torch.zeros_like(t, dtype=torch.float32) for t in m[:3]] for m in mine]
    rank_backward(mine, 0, merged, grads)


def measure(seq: int, heads: int, head_dim: int, cp: int, dtype: torch.dtype, device, repeats: int) -> dict:
    g = torch.Generator(device).manual_seed(0)
    q, k, v, dout = (torch.randn(1, heads, seq, head_dim, generator=g, device=device, dtype=dtype) for _ in range(4))
    whole(q, k, v, dout)  # warm-up: kernels chosen, memory pooled
    ring_timed(q, k, v, dout, cp)
    times = {"whole": [], "ring": []}
    for _ in range(repeats):
        times["whole"].append(sum(whole(q, k, v, dout)[:2]))
        times["ring"].append(sum(ring_timed(q, k, v, dout, cp)))
    want = whole(q, k, v, dout)[2:]
    errors = [
        ((a - b.float()).abs().max() / b.float().abs().max()).item()
        for a, b in zip(ring(q, k, v, dout, cp), want, strict=True)
    ]
    _, mine = split(q, k, v, dout, cp)
    memory = {"whole": peak(device, lambda: whole(q, k, v, dout)), "ring": peak(device, lambda: one_rank(mine, cp))}
    return {"seq": seq, "time": {s: statistics.median(t) for s, t in times.items()}, "memory": memory, "errors": errors}


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, "docs/ring.md", repeats=5)
    p.add_argument("--cp", type=int, default=CP, help=f"ranks whose blocks run (default {CP})")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the raw numbers as JSON")
    args = harness.parse(p, argv)
    if not (args.smoke or torch.cuda.is_available()):
        print("bench_ring: needs a GPU (the fused kernels' time and memory on one); --smoke checks it on the CPU")
        return
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    lengths, heads, head_dim = SMOKE if device.type == "cpu" else (LENGTHS, HEADS, HEAD_DIM)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    page = harness.Page("Ring attention's blocks on one GPU against sdpa on the whole sequence", args)
    rows = []
    for seq in lengths:
        r = measure(seq, heads, head_dim, args.cp, dtype, device, args.repeats)
        ratio = r["time"]["ring"] / r["time"]["whole"]
        r["ratio"] = ratio
        rows.append(r)
        print(f"bench_ring: {seq} tokens: ring ÷ whole {ratio:.2f}, errors {max(r['errors']):.1e}", flush=True)
    held = device.type == "cuda"
    table = [
        [r["seq"], f"{r['time']['whole'] * 1e3:.1f}", f"{r['time']['ring'] * 1e3:.1f}", f"{r['ratio']:.2f}"]
        + [f"{r['memory']['whole']:.0f}", f"{r['memory']['ring']:.0f}", f"{max(r['errors']):.1e}"]
        for r in rows
    ]
    head = ["tokens", "sdpa whole (ms)", f"ring, {args.cp} ranks (ms)", "ring ÷ whole"]
    head += ["whole adds (MiB)", "one rank adds (MiB)", "largest error"]
    body = [
        f"{heads} heads of {head_dim}, one sequence, {dtype}, causal, on {device.type}; forward and backward, "
        f"median of {args.repeats}: all {args.cp} ranks' blocks, run one rank after another without the exchanges "
        "(distrain/testing/ring.py), against sdpa on the whole sequence. The memory: the most one rank's blocks "
        "add to its inputs, and the whole's kernel to its. The error: the output's and the gradients' largest, "
        "relative to the largest value.",
        "",
        *harness.table(head, table, "rrrrrrr"),
    ]
    page.write("\n".join(body))
    raw = {"device": device.type, "tolerance": TOLERANCE, "held": held, "cp": args.cp, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1) + "\n")


if __name__ == "__main__":
    main()
