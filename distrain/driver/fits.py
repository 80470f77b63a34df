"""Refuse, before any worker starts, a run whose estimated memory per rank (`--plan`'s figure) exceeds what
its devices have: a run that cannot fit otherwise sits at its first step until it is declared hung, and is
retried. GPU workers: the smallest GPU's memory, as nvidia-smi reports it on each GPU node (asked by a
task that takes no GPU and imports nothing). CPU workers: the largest node's memory as Ray counts it
(`memory` + `object_store_memory`). The estimate leaves out the attention scores that `--plan` counts:
the fused attention kernels of CUDA and of the CPU never keep them (tests/test_memory.py measures the
CPU's), and with them a run that trains today (docs/mfu.md's llama_1b at seq_len 2048 on one H100:
111.5 GiB with them, 31.5 GiB without) would be refused. `trainer.check_memory=false` starts a run anyway."""

from __future__ import annotations

from collections.abc import Callable

from distrain.cluster.runtime import gpu_memory, node_memory
from distrain.config import ConfigError, TrainConfig, resolve_precision
from distrain.driver.plan import Memory, human, worker_memory
from distrain.strategy.layout import Layout

KNOBS = (
    "lower trainer.micro_batch_size or trainer.seq_len, set strategy.activation_checkpoint=true, shard the "
    "model state (strategy=zero3, or strategy=offload / nvme to keep it in CPU memory), or split the model "
    "(strategy.tp, strategy.pp) or the sequence (strategy.cp)"
)


def needed(mem: Memory, gpu: bool) -> int:
    """What the worker's device holds: on a GPU, all but what offload keeps in CPU memory; on a CPU, all."""
    return mem.device_total if gpu else mem.params + mem.grads + mem.optimizer + mem.activations


def check_fits(cfg: TrainConfig, layout: Layout, gpu: bool, say: Callable[[str], None]) -> None:
    """ConfigError naming the estimate, the capacity and the knobs when a rank cannot fit; said and skipped
    when the GPUs' memory cannot be read."""
    if not cfg.trainer.check_memory:
        return
    if gpu:
        found = gpu_memory()
        if found is None:
            say("memory check skipped: nvidia-smi did not report the GPUs' memory (trainer.check_memory)")
            return
        have, node = found
        what = f"the smallest GPU has {human(have)} (nvidia-smi on {node})"
    else:
        have, node = node_memory()
        what = f"the largest node has {human(have)} for workers (Ray's memory and object store on {node})"
    refused = refusal(cfg, layout, gpu, have, what)
    if refused is not None:
        raise refused


def refusal(cfg: TrainConfig, layout: Layout, gpu: bool, have: int, what: str) -> ConfigError | None:
    """The error for a rank whose estimate exceeds `have` bytes (`what`: where that figure comes from), or None."""
    precision = resolve_precision(cfg.trainer.precision, gpu)
    need = max(needed(mem, gpu) for mem in worker_memory(cfg, layout, precision, scores=False))
    if need <= have:
        return None
    return ConfigError(
        f"each rank needs an estimated {human(need)} ({precision}, attention scores not counted; `--plan` "
        f"shows the breakdown) but {what}: {KNOBS}; or set trainer.check_memory=false to start it anyway"
    )
