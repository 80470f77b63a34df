"""Refuse, before any worker starts, a run whose estimated memory per rank (`--plan`'s figure) exceeds what
its devices have: a run that cannot fit otherwise sits at its first step until it is declared hung, and is
retried. GPU workers: the smallest GPU's memory, as nvidia-smi reports it on each GPU node (asked by a
task that takes no GPU and imports nothing). CPU workers: the largest node's memory as Ray counts it
(`memory` + `object_store_memory`). An embedded cluster is checked before it starts, against what it will
have (`resources.embedded_resources`, nvidia-smi on this machine). The estimate leaves out the attention scores
that `--plan` counts: the fused attention kernels of CUDA and of the CPU never keep them (tests/test_memory.py
measures the CPU's), and with them a run that trains today (docs/mfu.md's llama_1b at seq_len 2048 on one
H100: 111.5 GiB with them, 31.5 GiB without) would be refused. `trainer.check_memory=false` starts a run
anyway. `verdict` says what the check would do, for `--plan`."""

from __future__ import annotations

from collections.abc import Callable

from distrain.cluster.resources import gpu_memory, node_memory, nvidia_smi, smallest_mib
from distrain.config import ConfigError, TrainConfig, resolve_precision
from distrain.driver.plan import Memory, human, worker_memory
from distrain.strategy.layout import Layout

KNOBS = (
    "lower trainer.micro_batch_size or trainer.seq_len, set strategy.activation_checkpoint=true or "
    "trainer.loss_chunk (the loss's logits a slice at a time), shard the "
    "model state (strategy=zero3, or strategy=offload / nvme to keep it in CPU memory), or split the model "
    "(strategy.tp, strategy.pp) or the sequence (strategy.cp)"
)
UNREAD = "nvidia-smi did not report the GPUs' memory"


def needed(mem: Memory, gpu: bool) -> int:
    """What the worker's device holds: on a GPU, all but what offload keeps in CPU memory; on a CPU, all."""
    return mem.device_total if gpu else mem.params + mem.grads + mem.optimizer + mem.activations + mem.logits


def capacity(gpu: bool, here: dict[str, float] | None) -> tuple[int, str] | None:
    """What a rank may hold, in bytes, and where that figure comes from; None when the GPUs' memory cannot be
    read. `here`: an embedded cluster's resources before it starts (this machine's); None: the cluster's, asked."""
    if gpu:
        mib = None if here is None else smallest_mib(nvidia_smi())
        found = gpu_memory() if here is None else (None if mib is None else (mib * 2**20, "this machine"))
        if found is None:
            return None
        return found[0], f"the smallest GPU has {human(found[0])} (nvidia-smi on {found[1]})"
    if here is not None:
        have = int(here["memory"])
        return have, f"this machine has {human(have)} for workers (what an embedded Ray cluster gives them)"
    have, node = node_memory()
    return have, f"the largest node has {human(have)} for workers (Ray's memory and object store on {node})"


def check_fits(
    cfg: TrainConfig, layout: Layout, gpu: bool, say: Callable[[str], None], here: dict[str, float] | None = None
) -> None:
    """ConfigError naming the estimate, the capacity and the knobs when a rank cannot fit; said and skipped
    when the GPUs' memory cannot be read."""
    if not cfg.trainer.check_memory:
        return
    found = capacity(gpu, here)
    if found is None:
        say(f"memory check skipped: {UNREAD} (trainer.check_memory)")
        return
    refused = refusal(cfg, layout, gpu, *found)
    if refused is not None:
        raise refused


def estimate(cfg: TrainConfig, layout: Layout, gpu: bool) -> tuple[int, str]:
    """The bytes the largest rank's device holds, attention scores not counted, and the precision it runs in."""
    precision = resolve_precision(cfg.trainer.precision, gpu)
    return max(needed(mem, gpu) for mem in worker_memory(cfg, layout, precision, scores=False)), precision


def refusal(cfg: TrainConfig, layout: Layout, gpu: bool, have: int, what: str) -> ConfigError | None:
    """The error for a rank whose estimate exceeds `have` bytes (`what`: where that figure comes from), or None."""
    need, precision = estimate(cfg, layout, gpu)
    if need <= have:
        return None
    return ConfigError(
        f"each rank needs an estimated {human(need)} ({precision}, attention scores not counted; `--plan` "
        f"shows the breakdown) but {what}: {KNOBS}; or set trainer.check_memory=false to start it anyway"
    )


def verdict(cfg: TrainConfig, layout: Layout, gpu: bool, here: dict[str, float] | None) -> str:
    """`--plan`'s line on what the memory check would do with this run: start it, or refuse it and why."""
    if not cfg.trainer.check_memory:
        return "memory check: off (trainer.check_memory=false): the run starts whatever the estimate"
    found = capacity(gpu, here)
    if found is None:
        return f"memory check: skipped, {UNREAD}"
    refused = refusal(cfg, layout, gpu, *found)
    if refused is not None:
        return f"memory check: the run would be refused: {refused}"
    need, precision = estimate(cfg, layout, gpu)
    return (
        f"memory check: passes: each rank needs an estimated {human(need)} ({precision}, attention scores not "
        f"counted) and {found[1]}"
    )
