"""The hand-written DDP baseline for jobs/bench/bench_ddp.py.

    torchrun --standalone --nproc_per_node=N jobs/bench/ddp_torchrun.py [--model nano --steps 60 ...]

What a user would write without distrain (nanoGPT style), on the same model, data, optimizer and
LR schedule as distrain's trainer, so that the benchmark's ratio is distrain's overhead alone.
Rank 0 prints one JSON line per step: step, loss, grad_norm, step_time_s and unix time.
`train()` is the whole loop in a process group already formed: jobs/bench/ddp_raytrain.py runs the same
function under Ray Train.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from distrain.compat import ddp_without_buffer_sync
from distrain.data.corpus import load_tokens
from distrain.data.loader import TRAIN, Batches, split
from distrain.driver.cli import compose
from distrain.model.llama import Transformer


def parser() -> argparse.ArgumentParser:
    """The job's options, shared by every launcher of `train()`."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="nano", help="a conf/model/*.yaml name")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    return p


def lr_at(args: argparse.Namespace, step: int) -> float:
    """Linear warmup, then cosine decay to lr * min_lr_ratio at the last step (as distrain)."""
    if step <= args.warmup:
        return args.lr * step / max(args.warmup, 1)
    progress = min((step - args.warmup) / max(args.steps - args.warmup, 1), 1.0)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(args: argparse.Namespace, device: torch.device, record: Callable[[dict], None]) -> None:
    """The job on this rank of the default process group; record(one step's figures) on every rank after
    every step, so that a launcher whose reporting is collective (Ray Train's) can call it everywhere."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    rank, world = dist.get_rank(), dist.get_world_size()
    accum = args.global_batch // (args.micro_batch * world)
    assert accum * args.micro_batch * world == args.global_batch, "global batch must split into micro-batches"

    model_cfg = compose([f"model={args.model}"]).model  # the preset, as `python jobs/train.py model=...` reads it
    model = Transformer(model_cfg, args.seq_len, seed=args.seed).to(device)
    # The same DDP options as distrain: the only buffers are constant rotary tables, so no forward sync.
    model = DDP(
        model,
        device_ids=[device] if device.type == "cuda" else None,
        bucket_cap_mb=args.bucket_cap_mb,
        gradient_as_bucket_view=True,
        **ddp_without_buffer_sync(),
    )
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [q for q in params if q.ndim >= 2], "weight_decay": args.weight_decay},
            {"params": [q for q in params if q.ndim < 2], "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=True,
    )
    train_tokens = split(load_tokens(None), 0.05, args.seq_len).train  # distrain's data.val_fraction=0.05
    batches = Batches(train_tokens, args.seq_len, args.global_batch, args.seed, TRAIN)

    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(args, step)
        x, y = batches.get(step, rank, world)
        loss_sum = torch.zeros((), device=device)
        for i, (xm, ym) in enumerate(zip(x.split(args.micro_batch), y.split(args.micro_batch), strict=True)):
            xm, ym = xm.to(device, non_blocking=True), ym.to(device, non_blocking=True)
            with contextlib.nullcontext() if i == accum - 1 else model.no_sync():
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                    logits = model(xm)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), ym.flatten())
                (loss / accum).backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss_sum)  # the global-batch mean, for logging
        loss_value, norm_value = loss_sum.item() / (accum * world), grad_norm.item()
        step_time = time.perf_counter() - t0
        record(
            {"step": step, "loss": loss_value, "grad_norm": norm_value, "step_time_s": step_time, "time": time.time()}
        )


def print_record(record: dict) -> None:
    """One step as the JSON line jobs/bench/bench_ddp.py reads from the console."""
    print(json.dumps(record), flush=True)


def main() -> None:
    args = parser().parse_args()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    train(args, device, print_record if dist.get_rank() == 0 else lambda _: None)
    # Waiting here releases the GIL, so a gloo thread still dropping the last all-reduce's tensors can finish
    # before the interpreter shuts down; without it a rank sometimes aborts on exit ("terminate called...").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
