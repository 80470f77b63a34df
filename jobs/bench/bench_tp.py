"""Bytes of 1-D, 2-D, 2.5-D and 3-D tensor parallelism per rank, counted against theory:  python jobs/bench/bench_tp.py

For each layout, p gloo processes on 127.0.0.1 (no Ray) build the model as a worker does (on the meta device,
laid out by `ParallelModel`) and take one training step of one micro-batch: an unmeasured one first, then
one under `distrain.parallel.traffic.Traffic`, which counts every collective each rank calls (bytes sent and
received, nccl-tests' convention), with the bytes autograd saves in the blocks for the backward
(`saved_activations`) and the parameters each rank holds. Beside each: distrain/strategy/tpcost.py's theory.
Writes docs/tensor-parallel.md and its plot (its numbers in docs/tensor-parallel.json: `--replot` redraws it).
"""

from __future__ import annotations

import harness  # first: it keeps Ray on loopback (nothing here starts Ray)
import torch
from plots import figure, log2_x  # jobs/bench/plots.py, beside this script

from distrain.config import ModelConfig, OptimConfig, StrategyConfig
from distrain.model.llama import Block, Transformer
from distrain.parallel.memory import local_bytes
from distrain.parallel.parallelize import ParallelModel
from distrain.parallel.traffic import Traffic, saved_activations
from distrain.strategy import tpcost
from distrain.strategy.resolve import layout_of
from distrain.strategy.tensor_parallel import grid
from distrain.testing import processes
from distrain.train.learner import cross_entropy
from distrain.train.optim import build_optimizer

# Wide enough that the weights' terms and the activations' both count (h² against n·h, n = 512 tokens);
# every split divides it: q² = 4 | dim, ffn, vocab; q | heads.
MODEL = {"dim": 512, "n_layers": 2, "n_heads": 8, "n_kv_heads": None, "ffn_dim": 1536, "vocab_size": 512}
BATCH, SEQ = 8, 64
SMOKE_MODEL = {"dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": None, "ffn_dim": 64, "vocab_size": 256}
SMOKE_BATCH, SMOKE_SEQ = 4, 16
# (mode, p, depth): every layout the modes allow at p = 4 and 8 (8 is no square: no 2-D; 2.5-D needs d·q²
# with q ≥ 2, so at 4 it is 2-D), and one process as the baseline.
CASES = [("1d", 1, 1), ("1d", 4, 1), ("2d", 4, 1), ("1d", 8, 1), ("2.5d", 8, 2), ("3d", 8, 1)]
SMOKE_CASES = [("1d", 2, 1), ("2d", 4, 1)]
# Every p up to 64 each mode can lay out (2.5-D at depth 2): the theory's lines, and where they cross 1-D's.
THEORY_P = {
    "1d": [1, 2, 4, 8, 16, 32, 64],
    "2d": [1, 4, 9, 16, 25, 36, 49, 64],
    "2.5d": [1, 8, 18, 32, 50],
    "3d": [1, 8, 27, 64],
}
COLOURS = {"1d": "#1f77b4", "2d": "#ff7f0e", "2.5d": "#2ca02c", "3d": "#d62728"}
MIB = 2**20


def label(mode: str, p: int, depth: int) -> str:
    if p == 1:
        return "one process"
    q, d = grid(mode, p, depth)
    return {"1d": f"1-D, tp {p}", "2d": f"2-D, {q}×{q}", "2.5d": f"2.5-D, {d}×{q}×{q}", "3d": f"3-D, {q}×{q}×{q}"}[mode]


def step_rank(rank: int, device: torch.device, mode: str, p: int, depth: int, model: dict, b: int, t: int) -> dict:
    """One rank: a step unmeasured, then one counted: its traffic, saved activations and parameter bytes."""
    cfg = ModelConfig(name="bench_tp", **model)
    grid = {"tp_mode": mode, "tp_depth": depth}
    layout = layout_of(tp=p, **grid)
    with torch.device("meta"):
        net = Transformer(cfg, t, seed=0)
    parallel = ParallelModel(net, StrategyConfig(dp_replicate=1, tp=p, **grid), layout, device, False, cross_entropy)
    optimizer = build_optimizer(parallel.module, OptimConfig(), parallel.zero1_group)
    x = torch.randint(0, cfg.vocab_size, (b, t + 1), generator=torch.Generator().manual_seed(0))
    parallel.forward_backward(x[:, :-1], x[:, 1:])
    optimizer.zero_grad(set_to_none=True)
    blocks = [m for m in parallel.module.modules() if isinstance(m, Block)]
    with Traffic() as passes, saved_activations(parallel.module, blocks) as held:
        loss = parallel.forward_backward(x[:, :-1], x[:, 1:])
    with Traffic() as rest:
        parallel.clip_grad_norm(1.0)
        optimizer.step()
    params = local_bytes(parallel.module.parameters())
    return {"passes": passes.ops, "rest": rest.ops, "held": held, "params": params, "loss": loss.item()}


def sent(ops: dict) -> float:
    return sum(row["sent"] for row in ops.values())


def measure(cases: list, model: dict, b: int, t: int) -> dict:
    """case → each rank's result."""
    out = {}
    for mode, p, depth in cases:
        print(f"bench_tp: {label(mode, p, depth)} ({p} processes) ...", flush=True)
        out[(mode, p, depth)] = processes.spawn_ranks(step_rank, p, mode, p, depth, model, b, t)
    return out


def ratio(got: float, want: float) -> str:
    return "—" if not want and not got else f"{got / want:.4f}" if want else "∞"


def body(results: dict, model: dict, b: int, t: int, plot_name: str) -> str:
    n = b * t
    traffic_rows, memory_rows, worst = [], [], 0.0
    for (mode, p, depth), ranks in results.items():
        theory = tpcost.tp_traffic(model, mode, p, depth, b, t)
        memory = tpcost.tp_memory(model, mode, p, depth, b, t)
        step = [sent(r["passes"]) + sent(r["rest"]) for r in ranks]
        ops = ranks[0]["passes"]
        by_op = ", ".join(f"{k} {v['calls']}× {v['sent'] / MIB:.3f}" for k, v in sorted(ops.items()) if v["sent"])
        rest = max(sent(r["rest"]) for r in ranks)
        traffic_rows.append(
            [label(mode, p, depth), p, f"{max(step) / MIB:.3f}", f"{theory['total'] / MIB:.3f}"]
            + [ratio(max(step), theory["total"]), f"{rest / 2**10:.1f}", by_op or "—"]
        )
        weights, acts = max(r["params"] for r in ranks), max(r["held"]["inside"] for r in ranks)
        off = max(abs(w / memory[k] - 1) for k, w in (("weights", weights), ("activations", acts)))
        worst = max(worst, off)
        memory_rows.append(
            [label(mode, p, depth), p, f"{weights / MIB:.3f}", f"{memory['weights'] / MIB:.3f}"]
            + [ratio(weights, memory["weights"]), f"{acts / MIB:.3f}", f"{memory['activations'] / MIB:.3f}"]
            + [ratio(acts, memory["activations"]), "yes" if off <= 0.10 else "**no**"]
            + [f"{max(r['held']['bytes'] for r in ranks) / MIB:.3f}"]
        )
    s = tpcost.shape(model)
    head = ["layout", "p", "sent per rank, measured (MiB)", "theory (MiB)", "measured ÷ theory"]
    head += ["of it after the backward (KiB)", "forward + backward by op: calls, MiB sent"]
    mem_head = ["layout", "p", "weights, measured (MiB)", "theory (MiB)", "÷", "block activations, measured (MiB)"]
    mem_head += ["theory (MiB)", "÷", "within 10%", "all saved activations (MiB)"]
    lines = [
        f"Model: dim h = {s['h']}, {s['L']} layers, {s['H']} heads, ffn f = {s['f']}, vocabulary V = {s['V']}; "
        f"one micro-batch of {b} sequences × {t} tokens (n = {n}); fp32. Each layout's ranks are gloo processes "
        "on this machine (`torch.multiprocessing`, no Ray), built as a worker builds them (`ParallelModel`).",
        "",
        "## Bytes sent per rank in one training step",
        "",
        "Counted, not estimated: `distrain.parallel.traffic.Traffic` (a `TorchDispatchMode`) sees every c10d and "
        "functional collective a rank calls, forward and backward, and counts it under nccl-tests' convention "
        "(docs/collectives.md): for a group of g ranks and n bytes, all-reduce 2(g−1)/g·n, all-gather (n: output), "
        "reduce-scatter (n: input), broadcast and reduce (g−1)/g·n. Received equals sent for each of them. The "
        "step is `forward_backward` (with the grid layouts' gradient sync) then `clip_grad_norm` and the "
        "optimizer's step; theory (distrain/strategy/tpcost.py) is the forward, backward and gradient sync, op by op. "
        "Every rank of a layout sent the same bytes; the table gives the largest.",
        "",
        *harness.table(head, traffic_rows, "lrrrrrl"),
        "",
        "## Bytes held per rank",
        "",
        "Weights: the rank's parameters (a DTensor's local shard). Block activations: what autograd saves inside "
        "the transformer blocks for the backward of one micro-batch, each storage once, parameters and buffers "
        "left out (`saved_activations`); the last column adds what the embedding, the final norm and the loss "
        f"save. Every rank holds the same; the table gives the largest. Largest gap to theory: {worst:.2%}.",
        "",
        *harness.table(mem_head, memory_rows, "lrrrrrrrlr"),
        "",
        "## The algorithms' costs per linear layer",
        "",
        *formulas(n, s["h"]),
        "",
        "## Reading",
        "",
        reading(results, model, b, t),
        "",
        f"![bytes per rank against p]({plot_name})",
    ]
    return "\n".join(lines)


def formulas(n: int, h: int) -> list[str]:
    """The per-linear volumes, X [n, h] · W [h, h], elements one rank sends in the forward and backward."""
    rows = [
        ["1-D, Megatron-SP (Korthikanti et al. 2022)", "p", "4(p−1)/p · n·h per pair of linears (AG + RS, twice)"],
        ["2-D, SUMMA (Optimus, Xu et al. 2021)", "q²", "3(q−1)(n·h + h²)/q²"],
        ["2.5-D (Tesseract, Wang et al. 2021)", "d·q²", "3(q−1)(n·h/d + h²)/q², + 2(d−1)/d · h²/q² (dW over depth)"],
        ["3-D (Bian et al. 2021)", "q³", "2(q−1)(2·n·h + h²)/q³"],
    ]
    at = {
        "1d": 4 * 7 / 8 * n * h,
        "2d": tpcost.linear_traffic("2d", 2, 1, n, h, h),
        "2.5d": tpcost.linear_traffic("2.5d", 2, 2, n, h, h) + h * h / 4,
        "3d": tpcost.linear_traffic("3d", 2, 1, n, h, h),
    }
    cases = {"1d": "p = 8", "2d": "q = 2 (p = 4)", "2.5d": "d = q = 2 (p = 8)", "3d": "q = 2 (p = 8)"}
    body_rows = [[*r, f"{at[m] * 4 / MIB:.3f} at {cases[m]}"] for r, m in zip(rows, at, strict=True)]
    head = ["scheme", "p", "elements sent per rank, forward + backward", f"MiB here (n = {n}, h = {h}, fp32)"]
    return [
        "For X [n, h] times a square weight [h, h] under our counting convention; distrain's layers do exactly "
        "these collectives (tpcost.linear_traffic), so the tables above are these summed over the model's linears "
        "plus the embedding, norms and loss. 1-D's cost does not fall with p; 2-D's falls as 1/√p, 3-D's as "
        "p^(−2/3), and 2.5-D trades depth (copies of the weights) for less traffic on the activations.",
        "",
        *harness.table(head, body_rows, "lrll"),
    ]


def reading(results: dict, model: dict, b: int, t: int) -> str:
    """Which layout moved and held least at each p, from the measurements."""
    parts = []
    for p in sorted({c[1] for c in results if c[1] > 1}):
        here = {c: r for c, r in results.items() if c[1] == p}
        traffic = {c: max(sent(x["passes"]) + sent(x["rest"]) for x in r) for c, r in here.items()}
        held = {c: max(x["params"] + x["held"]["inside"] for x in r) for c, r in here.items()}
        least, most = min(traffic, key=traffic.get), max(traffic, key=traffic.get)
        lean = min(held, key=held.get)
        parts.append(
            f"At p = {p}, {label(*least)} sent least ({traffic[least] / MIB:.1f} MiB per rank"
            + (f", {traffic[most] / traffic[least]:.2f}× less than {label(*most)}" if most != least else "")
            + f") and {label(*lean)} held least (weights and block activations, {held[lean] / MIB:.1f} MiB)."
        )
    n, h = b * t, model["dim"]

    def theory(mode: str, p: int) -> float:
        return tpcost.tp_traffic(model, mode, p, 2 if mode == "2.5d" else 1, b, t)["total"]

    cross = {m: next((p for p in ps if p > 1 and theory(m, p) < theory("1d", p)), None) for m, ps in THEORY_P.items()}
    below = [f"{m} from p = {p}" for m, p in cross.items() if m != "1d" and p] or ["none up to p = 64"]
    parts.append(
        f"Here n = {n} tokens per micro-batch against h = {h}. 1-D moves only activations, (p−1)/p·n·h per "
        "collective, so its bytes per rank grow toward a ceiling as p grows and never fall; the grids move weights "
        "too and pay most at small p, but divide what they move by q or more. In theory (the plot's lines) a grid "
        f"sends less per rank than 1-D at the same p: {', '.join(below)}. 1-D's activations stop at each "
        "sublayer's all-gathered input (2·n·h per block, whatever p); the grids' fall as 1/p, but for 3-D's "
        "gathered X and W. Reading: 1-D while p is below those crossings, where it sends least and holds about as "
        "little as any; 2-D or 2.5-D when activations or weights must shrink further than 1-D can take them; 3-D "
        "when p is a large cube and traffic per rank must fall with p."
    )
    return " ".join(parts)


def plot_data(results: dict, model: dict, b: int, t: int) -> dict:
    """What the plot shows: the job (for the theory's lines) and each layout's measured bytes per rank (MiB)."""
    measured = [
        {
            "mode": mode,
            "p": p,
            "sent_mib": max(sent(r["passes"]) + sent(r["rest"]) for r in ranks) / MIB,
            "held_mib": max(r["params"] + r["held"]["inside"] for r in ranks) / MIB,
        }
        for (mode, p, _), ranks in results.items()
    ]
    return {"model": model, "batch": b, "seq": t, "measured": measured}


def draw(data: dict):  # noqa: ANN201  (a matplotlib Figure)
    """Bytes sent per rank (left) and held per rank (right) against p: theory as lines, measured as dots
    (one process's in every mode's colour)."""
    model, b, t, measured = data["model"], data["batch"], data["seq"], data["measured"]
    modes = [m for m in THEORY_P if any(x["mode"] == m for x in measured)]

    def sent_theory(m: str, p: int, d: int) -> float:
        return tpcost.tp_traffic(model, m, p, d, b, t)["total"]

    def held_theory(m: str, p: int, d: int) -> float:
        return sum(tpcost.tp_memory(model, m, p, d, b, t).values())

    panels = [
        ("sent per rank in one step (MiB)", "sent_mib", sent_theory),
        ("weights + block activations (MiB)", "held_mib", held_theory),
    ]
    fig, axes = figure(9.8, 4.0, 1, 2)
    for ax, (title, key, theory) in zip(axes[0], panels, strict=True):
        for m in modes:
            mib = [theory(m, p, 2 if m == "2.5d" else 1) / MIB for p in THEORY_P[m]]
            ax.plot(THEORY_P[m], mib, color=COLOURS[m], label=f"{m} theory; dots measured")
            dots = [(x["p"], x[key]) for x in measured if x["mode"] == m or x["p"] == 1]
            ax.plot(*zip(*dots, strict=True), "o", color=COLOURS[m])
        log2_x(ax, [1, 2, 4, 8, 16, 32, 64])
        ax.set_ylim(bottom=0)
        ax.set_title(title, loc="left")
        ax.set_xlabel("tensor-parallel ranks p (log scale)")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="outside lower center", ncols=len(modes), frameon=False)
    return fig


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, "docs/tensor-parallel.md", repeats=1, plot=True)
    args = harness.parse(p, argv)
    if harness.replot(args, draw):
        return
    model, b, t = (SMOKE_MODEL, SMOKE_BATCH, SMOKE_SEQ) if args.smoke else (MODEL, BATCH, SEQ)
    cases = SMOKE_CASES if args.smoke else CASES
    page = harness.Page("Tensor parallelism: bytes per rank, measured against theory", args)
    results = measure(cases, model, b, t)
    text = body(results, model, b, t, page.plot)
    print(text)
    page.write(text, plot=(draw, plot_data(results, model, b, t)))


if __name__ == "__main__":
    main()
