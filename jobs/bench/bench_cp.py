"""Context parallelism: the longest sequence per memory budget, ring against all-to-all:  python jobs/bench/bench_cp.py

4 gloo processes on 127.0.0.1 (no Ray) build the model as a worker does (on the meta device, laid out by
`ParallelModel`) with cp = 1 (the 4 ranks data-parallel), 2 (× dp 2) and 4, each rank one sequence per step.
Memory: the peak of the bytes a rank's live tensors hold during one training step (every tensor an op
creates counted from its creation until it is freed: what the step needs, not what the allocator caches), at
sequence lengths doubling until a rank passes the budget; the longest that stayed within it is the one that
trains. Time: the median step at a few lengths in each mode, cp 2 and 4.
"""

from __future__ import annotations

import statistics
import time
import weakref

import harness  # first: it keeps Ray on loopback (nothing here starts Ray)
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from distrain.config import ModelConfig, StrategyConfig
from distrain.model.llama import Transformer
from distrain.parallel.parallelize import ParallelModel
from distrain.strategy.resolve import layout_of
from distrain.testing import processes
from distrain.train.learner import cross_entropy

WORLD = 4
MODEL = {"dim": 256, "n_layers": 2, "n_heads": 8, "n_kv_heads": None, "ffn_dim": 512, "vocab_size": 256}
LENGTHS, BUDGET_MIB, TIMED, REPEATS = [2**k for k in range(10, 16)], 256, [2048, 4096], 3
SMOKE_MODEL = {"dim": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": None, "ffn_dim": 64, "vocab_size": 256}
SMOKE = ([64, 128, 256], 1, [128], 1)
MIB = 2**20


class LiveBytes(TorchDispatchMode):
    """While entered, the bytes of the tensors ops create and that are still alive (each storage once), and
    their peak: `peak`. Tensors made before it (weights, optimizer state already there) are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.live, self.peak, self.seen = 0, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.count(t.untyped_storage())
        return out

    def count(self, storage: torch.UntypedStorage) -> None:
        key = storage.data_ptr()
        if key in self.seen or not storage.nbytes():
            return
        self.seen.add(key)
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self.freed, key, storage.nbytes())

    def freed(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes


def build(
    cp: int, mode: str, seq: int, model: dict, device: torch.device
) -> tuple[ParallelModel, torch.optim.Optimizer]:
    cfg = ModelConfig(name="bench_cp", **model)
    layout = layout_of(dp_replicate=WORLD // cp, cp=cp, cp_mode=mode)
    with torch.device("meta"):
        net = Transformer(cfg, seq, seed=0)
    strategy = StrategyConfig(dp_replicate=WORLD // cp, cp=cp, cp_mode=mode)
    parallel = ParallelModel(net, strategy, layout, device, False, cross_entropy)
    return parallel, torch.optim.AdamW(parallel.module.parameters())


def step(parallel: ParallelModel, optimizer: torch.optim.Optimizer, seq: int) -> float:
    x = torch.randint(0, 256, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    started = time.perf_counter()
    parallel.forward_backward(x[:, :-1], x[:, 1:])
    parallel.clip_grad_norm(1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def longest_rank(rank: int, device: torch.device, cp: int, lengths: list, model: dict, budget: int) -> dict:
    """Each length in turn, until one rank's step grows its peak memory past the budget (all ranks agree)."""
    grown = {}
    for seq in lengths:
        parallel, optimizer = build(cp, "ring", seq, model, device)
        step(parallel, optimizer, seq)  # the optimizer's state made: the measured step holds only its own
        with LiveBytes() as live:
            step(parallel, optimizer, seq)
        peak = torch.tensor(float(live.peak))
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        grown[seq] = peak.item()
        del parallel, optimizer
        if peak.item() > budget:
            break
    return grown


def timed_rank(rank: int, device: torch.device, cp: int, lengths: list, model: dict, repeats: int) -> dict:
    times = {}
    for seq in lengths:
        for mode in ("ring", "alltoall"):
            parallel, optimizer = build(cp, mode, seq, model, device)
            step(parallel, optimizer, seq)
            times[f"{mode}/{seq}"] = statistics.median(step(parallel, optimizer, seq) for _ in range(repeats))
    return times


def rank_main(
    rank: int, device: torch.device, lengths: list, model: dict, budget: int, timed: list, repeats: int
) -> dict:
    """Every measurement in one spawn of the 4 ranks: each layout is a ParallelModel of its own on them."""
    grown = {cp: longest_rank(rank, device, cp, lengths, model, budget) for cp in (1, 2, 4)}
    return {"grown": grown, "times": {cp: timed_rank(rank, device, cp, timed, model, repeats) for cp in (2, 4)}}


def body(grown: dict, times: dict, model: dict, lengths: list, budget: int, timed: list) -> str:
    fits = {cp: max((s for s, g in by.items() if g <= budget), default=None) for cp, by in grown.items()}
    mem_rows = [
        [f"cp {cp}" + (" (dp 4)" if cp == 1 else ""), f"{fits[cp] or '—'}"]
        + [f"{by[s] / MIB:.0f}" if s in by else "" for s in lengths]
        for cp, by in grown.items()
    ]
    time_rows = [
        [f"cp {cp}", seq, f"{t[f'ring/{seq}']:.3f}", f"{t[f'alltoall/{seq}']:.3f}"]
        + [f"{t[f'ring/{seq}'] / t[f'alltoall/{seq}']:.2f}"]
        for cp, t in times.items()
        for seq in timed
    ]
    base = fits[1] or 0
    gain = ", ".join(f"cp {cp}: {fits[cp] / base:.0f}×" for cp in grown if cp > 1 and fits[cp] and base)
    return "\n".join(
        [
            f"Model: Llama, dim {model['dim']}, {model['n_layers']} layers, {model['n_heads']} heads, ffn "
            f"{model['ffn_dim']}, vocabulary {model['vocab_size']}; fp32, AdamW; one sequence per rank per step. "
            f"Each layout's {WORLD} ranks are gloo processes on this machine (`torch.multiprocessing`, no Ray), "
            "built as a worker builds them (`ParallelModel`).",
            "",
            f"## The longest sequence that trains within {budget / MIB:.0f} MiB per rank",
            "",
            "Peak bytes of live tensors during one training step (MiB; the most of the 4 ranks; what the step "
            "makes, the weights and optimizer state left out), the sequence doubling until one passes the budget. "
            "Ring attention for cp > 1.",
            "",
            *harness.table(
                ["layout", "longest within budget", *map(str, lengths)], mem_rows, "l" + "r" * (len(lengths) + 1)
            ),
            "",
            f"Longest sequence against cp 1: {gain or '—'}.",
            "",
            "## Step time, ring against all-to-all",
            "",
            f"Median of {REPEATS} steps (s) after one unmeasured, on the same ranks.",
            "",
            *harness.table(
                ["layout", "sequence", "ring (s)", "all-to-all (s)", "ring ÷ all-to-all"], time_rows, "lrrrr"
            ),
            "",
            "## Reading",
            "",
            "What a rank holds for the backward grows with its tokens (seq/cp), so the longest sequence that fits "
            "grows about as cp. The two modes move different things: the ring passes K and V cp − 1 hops and "
            "overlaps each hop with a block of attention, one call of the fused attention kernel sdpa picks (the "
            "CPU's flash attention here) through the op that also returns the log-sum-exp the blocks are merged "
            "by; all-to-all moves Q, K, V and the output once each way and runs the same kernel on the whole "
            "sequence with heads/cp heads. All-to-all needs cp | heads (and kv-heads); the ring has no such limit. "
            "The peak counts the tensors ops create; a fused kernel's working tiles, inside it, are not among them. "
            "`--plan` counts the two so: all-to-all's attention scores (heads/cp of them, over the whole sequence) "
            "as it counts them without cp, and for the ring none, but at most the fp32 tiles its math fallback "
            "(plain matmuls, TILE query rows at a time, where sdpa would pick its math path) holds while a block's "
            "backward runs (`strategy/context_parallel.ring_scores`). The ring's blocks on a GPU (flash, "
            "memory-efficient or cuDNN attention) are still to be measured: `jobs/bench/bench_ring.py`, "
            "jobs/gpu_check.py's ring part.",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, "docs/context-parallel.md", repeats=REPEATS)
    args = harness.parse(p, argv)
    lengths, budget_mib, timed, repeats = SMOKE if args.smoke else (LENGTHS, BUDGET_MIB, TIMED, args.repeats)
    model = SMOKE_MODEL if args.smoke else MODEL
    page = harness.Page("Context parallelism: longest sequence per memory, ring against all-to-all", args)
    budget = budget_mib * MIB
    print("bench_cp: the longest sequence at cp 1, 2 and 4, then step times, on 4 ranks ...", flush=True)
    got = processes.spawn_ranks(rank_main, WORLD, lengths, model, budget, timed, repeats)[0]  # JSON: string keys
    grown = {int(cp): {int(s): g for s, g in by.items()} for cp, by in got["grown"].items()}
    times = {int(cp): t for cp, t in got["times"].items()}
    text = body(grown, times, model, lengths, budget, timed)
    print(text)
    page.write(text)


if __name__ == "__main__":
    main()
