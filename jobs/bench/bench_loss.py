"""The chunked loss: a step's peak memory at a 128k vocabulary, whole against chunked:  python jobs/bench/bench_loss.py

One training step (forward, backward, AdamW) of a small Llama with a 128k vocabulary on one long sequence, built
as a worker builds it (`ParallelModel`, on the GPU when there is one, fp32), with the head and loss over the whole
sequence (`trainer.loss_chunk=0`, today's) and over slices (`trainer.loss_chunk` > 0). Each configuration runs in a
fresh process, one step unmeasured first, then:

- on the CPU, the peak of the bytes the step's live tensors hold (every tensor an op makes, from its creation
  until it is freed: bench_cp's `LiveBytes`; the weights and optimizer state made before the step are left out)
  and the growth of the process's peak resident memory during the step (Linux's VmHWM, reset first): the first
  counts what the step needs, the second what the operating system gave it;
- on a GPU, torch's own count: `torch.cuda.max_memory_allocated` during the step, less what was allocated before;
- the median step time of a few steps.
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import harness  # first: it keeps Ray on loopback (nothing here starts Ray)

# Narrow (dim 64): the logits' size is the vocabulary's and the sequence's, and a 2-core CPU steps it in seconds.
MODEL = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": None, "ffn_dim": 256, "vocab_size": 131072}
SEQ, CHUNKS, REPEATS = 2048, [0, 256], 2
SMOKE_MODEL = {**MODEL, "dim": 32, "ffn_dim": 64, "vocab_size": 4096}
SMOKE = (256, [0, 64])
MIB = 2**20


def rss(field: str) -> int:
    """This process's VmRSS (now) or VmHWM (its peak) in bytes."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def measure(model: dict, seq: int, chunk: int, repeats: int) -> dict:
    """In a fresh process: one configuration's step memory and time."""
    import torch
    from bench_cp import LiveBytes

    from distrain.config import ModelConfig, StrategyConfig
    from distrain.model.llama import Transformer
    from distrain.parallel.parallelize import ParallelModel
    from distrain.strategy.resolve import single
    from distrain.train.learner import cross_entropy

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with torch.device("meta"):
        net = Transformer(ModelConfig(name="bench_loss", **model), seq, seed=0)
    parallel = ParallelModel(net, StrategyConfig(), single(1), device, False, cross_entropy, False, loss_chunk=chunk)
    optimizer = torch.optim.AdamW(parallel.module.parameters())
    x = torch.randint(0, model["vocab_size"], (1, seq + 1), generator=torch.Generator().manual_seed(0)).to(device)

    def step() -> tuple[float, float]:
        started = time.perf_counter()
        loss = parallel.forward_backward(x[:, :-1], x[:, 1:])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started, loss.item()

    step()
    got: dict = {"chunk": chunk, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    if device.type == "cuda":
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        got["peak"] = torch.cuda.max_memory_allocated() - before
    else:  # both on one step: LiveBytes' own bookkeeping is a few bytes a tensor
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
        before = rss("VmRSS")
        with LiveBytes() as live:
            step()
        got["rss"], got["peak"] = rss("VmHWM") - before, live.peak
    runs = [step() for _ in range(repeats)]
    got["time"], got["loss"] = statistics.median(t for t, _ in runs), runs[-1][1]
    return got


def body(rows: list[dict], model: dict, seq: int) -> str:
    whole = rows[0]
    cpu = whole["device"] == "cpu"
    logits = seq * model["vocab_size"] * 4
    table = [
        [
            "whole (0)" if r["chunk"] == 0 else f"{r['chunk']} tokens",
            f"{r['peak'] / MIB:,.0f}",
            *([f"{r['rss'] / MIB:,.0f}"] if cpu else []),
            f"{r['time']:.2f}",
            f"{r['time'] / whole['time']:.2f}",
            f"{r['loss']:.7f}",
        ]
        for r in rows
    ]
    head = ["trainer.loss_chunk", "peak (MiB)", *(["peak RSS growth (MiB)"] if cpu else []), "step (s)", "÷ whole"]
    best = min(rows, key=lambda r: r["peak"])
    counted = (
        "the live tensors the step makes (the weights and optimizer state made before it left out)"
        if cpu
        else "torch.cuda.max_memory_allocated during the step, less what was allocated before it"
    )
    return "\n".join(
        [
            f"Model: Llama, dim {model['dim']}, {model['n_layers']} layers, {model['n_heads']} heads, ffn "
            f"{model['ffn_dim']}, vocabulary {model['vocab_size']:,}; one sequence of {seq} tokens a step, fp32, "
            f"AdamW; on {whole['device']}, one process per row. The whole micro-batch's fp32 logits are "
            f"{logits / MIB:,.0f} MiB.",
            "",
            *harness.table([*head, "loss"], table),
            "",
            f"Peak: {counted}. "
            f"Chunked at {best['chunk']} tokens the step's peak is {best['peak'] / MIB:,.0f} MiB against "
            f"{whole['peak'] / MIB:,.0f} MiB whole ({whole['peak'] / best['peak']:.1f}× less); the losses agree to "
            f"{max(abs(r['loss'] - whole['loss']) for r in rows):.1e}. Each slice's head runs twice (its forward "
            "again in the backward), which is the step time's cost.",
            *(
                [
                    "",
                    "On a GPU the figure is still to be taken: jobs/gpu_check.py's `loss` part runs this benchmark "
                    "there and writes this page with torch.cuda.max_memory_allocated's peak.",
                ]
                if cpu
                else []
            ),
        ]
    )


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, "docs/loss.md", repeats=REPEATS)
    p.add_argument("--json", default=None, metavar="PATH", help="also write each row's numbers as JSON")
    args = harness.parse(p, argv)
    model, (seq, chunks) = (SMOKE_MODEL, SMOKE) if args.smoke else (MODEL, (SEQ, CHUNKS))
    page = harness.Page("The chunked loss: peak memory at a 128k vocabulary, whole against chunked", args)
    rows = []
    for chunk in chunks:  # a fresh process each: the peak of one cannot hide in another's
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            rows.append(pool.submit(measure, model, seq, chunk, args.repeats).result())
        print(f"bench_loss: loss_chunk={chunk}: {rows[-1]}", flush=True)
    text = body(rows, model, seq)
    print(text)
    page.write(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "model": model, "seq": seq}, indent=1) + "\n")


if __name__ == "__main__":
    main()
