"""The loops jobs/bench/bench_mfu.py measures distrain against: one process, one device, no Ray, no FSDP.

    python jobs/bench/mfu_loop.py plain|transformers <the Hydra overrides of distrain's run>

What a user would write in plain PyTorch, on the run's own config (model, batch, micro-batch, seq_len,
precision, strategy.compile, optimizer, seed, data), so that the benchmark's ratios are distrain's
overhead alone:

- `plain`: distrain's model class itself, built as its contract says (on the meta device, then
  `to_empty` on the device and `init_weights()`), without any of distrain's layout or trainer;
- `transformers`: the Hugging Face implementation of the same shape (`LlamaForCausalLM`,
  `GPT2LMHeadModel`), its config from `distrain.model.hf.hf_config`, with SDPA attention and, as
  distrain's, no dropout.

Both train the same way: fp32 weights under bf16 autocast (trainer.precision), the global batch's
micro-batches forward and backward (the loss of each divided by their number), gradient clipping,
AdamW (fused on a GPU) with distrain's schedule, the same batches as distrain's run. With
strategy.compile=true each decoder block is compiled on its own (`fullgraph=True`), as distrain does.
Timed as distrain's trainer times a step: a step's loss is read back once the next step has been queued
(so the host never waits on the device in between), and its time runs from there at the step before to
there at this one. Prints one JSON line per step: step, loss, tokens_per_s, step_time_s,
peak_memory_bytes, time (unix, when the line is printed).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

from distrain.config import TrainConfig, resolve_precision
from distrain.data.loader import run_batches
from distrain.driver.cli import compose
from distrain.model.contract import tie
from distrain.model.hf import hf_config
from distrain.model.registry import build_model
from distrain.train.learner import cross_entropy, local_device
from distrain.train.metrics import memory_peaks
from distrain.train.optim import lr_at, set_lr

SIDES = ("plain", "transformers")
HF_BLOCKS = {"LlamaForCausalLM": "model.layers", "GPT2LMHeadModel": "transformer.h"}  # the decoder blocks
# distrain's models have no dropout; transformers' GPT-2 defaults to 0.1 in three places.
NO_DROPOUT = {"GPT2LMHeadModel": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}}


def plain(cfg: TrainConfig, device: torch.device) -> tuple[nn.Module, list[nn.Module], Callable]:
    """distrain's model on `device` as its contract builds it: its blocks, and logits of tokens."""
    with torch.device("meta"):
        model = build_model(cfg.model, cfg.trainer.seq_len, seed=cfg.trainer.seed)
    model.to_empty(device=device)
    tie(model)  # to_empty replaced the tied parameters one by one
    model.init_weights()
    return model, list(model.layers.values()), model


def transformers_model(cfg: TrainConfig, device: torch.device) -> tuple[nn.Module, list[nn.Module], Callable]:
    """The Hugging Face counterpart of the same shape on `device`: its blocks, and logits of tokens."""
    import transformers

    config = hf_config(cfg.model, cfg.trainer.seq_len)
    arch = config.pop("architectures")[0]
    with torch.device(device):
        model = getattr(transformers, arch)(
            transformers.AutoConfig.for_model(
                **config, **NO_DROPOUT.get(arch, {}), attn_implementation="sdpa", use_cache=False
            )
        )
    return model, list(model.get_submodule(HF_BLOCKS[arch])), lambda tokens: model(input_ids=tokens).logits


def train(side: str, cfg: TrainConfig) -> None:
    """Train `cfg.trainer.max_steps` steps, a JSON line each."""
    t, device = cfg.trainer, local_device()
    torch.manual_seed(t.seed)
    model, blocks, logits = (plain if side == "plain" else transformers_model)(cfg, device)
    if cfg.strategy.compile:
        for block in blocks:  # as distrain.parallel.parallelize.apply_compile
            block.compile(fullgraph=True)
    o = cfg.optim
    kernel = {"fused": True} if device.type == "cuda" else {"foreach": True}
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, **kernel
    )
    bf16 = resolve_precision(t.precision, gpu=device.type == "cuda") == "bf16"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    batches, _ = run_batches(cfg)
    micro = t.global_batch_size // t.micro_batch_size
    memory_peaks(device, reset=True)
    tokens, since, queued = t.global_batch_size * t.seq_len, time.perf_counter(), None
    for step in range(1, t.max_steps + 1):
        set_lr(optimizer, lr_at(step, o, t.max_steps))
        x, y = (v.to(device, non_blocking=True) for v in batches.get(step))
        total = torch.zeros((), device=device)
        for xm, ym in zip(x.chunk(micro), y.chunk(micro), strict=True):
            with autocast:
                loss = cross_entropy(logits(xm), ym)
            (loss / micro).backward()
            total += loss.detach()
        if o.grad_clip > 0:
            nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if queued is not None:  # this step is queued: reading the previous one's loss waits only for that one
            report(*queued, tokens, device)
        now = time.perf_counter()  # as distrain's trainer: the step's time runs to here, its loss is read later
        queued, since = (step, total / micro, now - since), now  # the loss: the micro-batches' mean, as distrain's
    report(*queued, tokens, device)


def report(step: int, loss: torch.Tensor, step_time_s: float, tokens: int, device: torch.device) -> None:
    """Print the step's line once its loss is on the host."""
    record = {"step": step, "loss": loss.item(), "tokens_per_s": tokens / step_time_s, "step_time_s": step_time_s}
    print(json.dumps(record | memory_peaks(device, reset=True) | {"time": time.time()}), flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in SIDES:
        raise SystemExit(f"usage: python jobs/bench/mfu_loop.py {{{','.join(SIDES)}}} [Hydra overrides ...]")
    train(argv[0], compose(argv[1:]))


if __name__ == "__main__":
    main()
