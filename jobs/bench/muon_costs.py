"""Muon's costs per layout, against AdamW's and against theory:  python jobs/bench/muon_costs.py [overrides]

For each layout, 4 gloo processes on 127.0.0.1 (no Ray) build the default job's model as a worker does and take
a few steps: the seconds of the forward and backward and of the optimizer's step (the mean of the steps after
the first), and, under `distrain.parallel.traffic.Traffic`, the bytes one optimizer step sends per rank. Beside
them the theory of Muon's gather and scatter (distrain/train/muon.py): each batch of W same-shaped m×n matrices
(W: the ranks holding different shards of them) goes to its owners by an all-to-all and comes back by another,
in bfloat16, so a rank sends 2·(W−1)/W·m·n·2 bytes per batch; on gloo DTensor does each all-to-all as an
all-gather, W times that. Prints a markdown table (docs/optimizers.md holds one).
"""

from __future__ import annotations

import sys
import time

import harness  # noqa: F401  (first: it keeps Ray on loopback; nothing here starts Ray)
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from distrain.config import from_plain, to_plain
from distrain.driver.cli import compose
from distrain.driver.validation import validate
from distrain.parallel.traffic import Traffic
from distrain.strategy.layout import Layout
from distrain.testing import processes
from distrain.train.faults import Faults
from distrain.train.learner import Learner
from distrain.train.muon import Muon, holders
from distrain.train.optim import build_optimizer, parts

WORLD, STEPS = 4, 4
LAYOUTS = {
    "ddp": ("strategy=ddp",),
    "zero1": ("strategy=zero1",),
    "zero3": ("strategy=zero3",),
    "hsdp": ("strategy=hsdp",),
    "tp": ("strategy=tp",),
    "fsdp_tp": ("strategy=fsdp_tp",),
    "pp": ("strategy=pp",),
}


def theory(optimizer: object) -> float:
    """Bytes one rank sends per step by Muon's all-to-alls: batches of each shape and placement, padded."""
    batches: dict[tuple, list[torch.Tensor]] = {}
    for muon in (p for p in parts(optimizer) if isinstance(p, Muon)):
        for p in (p for g in muon.param_groups for p in g["params"] if isinstance(p, DTensor)):
            if (w := holders(p)) > 1:
                batches.setdefault((p.shape, p.device_mesh, p.placements, w), []).append(p)
    return sum(2 * (w - 1) / w * shape.numel() * 2 * -(-len(ps) // w) for (shape, _, _, w), ps in batches.items())


def measure(rank: int, device: torch.device, cases: dict) -> dict:
    rows = {}
    for name, (plain, layout) in cases.items():
        cfg, layout = from_plain(plain), Layout.from_dict(layout)
        learner = Learner(cfg, layout, layout.data_shard(rank), device, Faults(cfg.fault, rank, None))
        optimizer = build_optimizer(learner.module, cfg.optim, learner.parallel.zero1_group)
        seconds, traffic = [0.0, 0.0], Traffic()
        for step in range(STEPS + 1):
            dist.barrier()
            start = time.perf_counter()
            learner.forward_backward(step)
            dist.barrier()
            middle = time.perf_counter()
            with traffic if step == STEPS else Traffic():
                optimizer.step()
            dist.barrier()
            optimizer.zero_grad(set_to_none=True)
            if step:
                seconds[0] += (middle - start) / STEPS
                seconds[1] += (time.perf_counter() - middle) / STEPS
        rows[name] = {"seconds": seconds, "sent": traffic.total("sent"), "theory": theory(optimizer)}
    return rows


def cases(optim: str, argv: list[str], layouts: dict[str, tuple[str, ...]]) -> dict:
    """Each layout's config and its layout, in plain data for the ranks."""
    out = {}
    for name, overrides in layouts.items():
        cfg = compose([f"optim={optim}", f"cluster.num_workers={WORLD}", *overrides, *argv])
        out[name] = (to_plain(cfg), validate(cfg).as_dict())
    return out


def main(argv: list[str]) -> None:
    print("| layout | optim | forward+backward s | optimizer step s | share | sent per step | all-to-all theory |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for optim in ("adamw", "muon"):
        row = processes.spawn_ranks(measure, WORLD, cases(optim, argv, LAYOUTS))[0]
        for name in LAYOUTS:
            (fb, step), sent, want = row[name]["seconds"], row[name]["sent"], row[name]["theory"]
            print(
                f"| {name} | {optim} | {fb:.3f} | {step:.3f} | {step / (fb + step):.0%} | {sent / 2**20:.2f} MiB "
                f"| {want / 2**20:.2f} MiB |",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1:])
