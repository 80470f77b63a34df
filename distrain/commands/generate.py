"""Sample from a trained run:

    distrain generate run.name=NAME prompt="def " [max_new_tokens=200] [temperature=0.8] [top_k=50]
                      [seed=0] [step=N] [device=auto|cpu|cuda] [run.storage=runs]
    (a checkout: python jobs/generate.py run.name=NAME prompt="def " [...])

From the newest committed checkpoint (or step N's), whatever layout wrote it; the run's own tokenizer.
temperature=0 is greedy; top_k=0 keeps the whole vocabulary. Prints the prompt and its continuation.
Bad input: one line and exit status 2."""

from __future__ import annotations

import torch
from torch import nn

from distrain.config import ConfigError

ARGUMENTS = (
    'run.name=NAME prompt="def " [max_new_tokens=200] [temperature=0.8] [top_k=50] '
    "[seed=0] [step=N] [device=auto|cpu|cuda] [run.storage=runs]"
)


@torch.no_grad()
def sample(
    model: nn.Module,
    ids: list[int],
    max_new_tokens: int,
    context: int,
    temperature: float = 0.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    stop: int | None = None,
) -> list[int]:
    """`ids` continued by up to max_new_tokens tokens, each from the logits of the last `context` tokens
    (the longest sequence the model has positions for); greedy at temperature 0; ends early at `stop`."""
    device = next(model.parameters()).device
    out = list(ids)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([out[-context:]], device=device))[0, -1].float()
        if temperature == 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                logits[logits < logits.topk(top_k).values[-1]] = float("-inf")
            token = int(torch.multinomial(logits.softmax(-1).cpu(), 1, generator=generator))
        out.append(token)
        if token == stop:
            break
    return out


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"device={name!r}: choose auto, cpu or cuda")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda: no GPU is visible here; use device=cpu (or auto)")
    return torch.device(name)


def generate(args: dict) -> str:
    from distrain.data.tokenizer import run_tokenizer
    from distrain.driver.trained import load_trained
    from distrain.urls import run_location

    if args["temperature"] < 0 or args["top_k"] < 0 or args["max_new_tokens"] < 0:
        raise ConfigError("temperature, top_k and max_new_tokens must be ≥ 0 (temperature=0: greedy; top_k=0: all)")
    device = resolve_device(args["device"])
    cfg, model = load_trained(run_location(args["run.storage"], args["run.name"]), args["step"])
    tokenizer = run_tokenizer(cfg)
    ids = tokenizer.encode(args["prompt"])
    if not ids:
        raise ConfigError('prompt= is empty: give the text to continue, e.g. prompt="def "')
    generator = torch.Generator().manual_seed(args["seed"])
    out = sample(
        model.to(device),
        ids,
        args["max_new_tokens"],
        cfg.trainer.seq_len,
        args["temperature"],
        args["top_k"],
        generator,
        tokenizer.eos_id,
    )
    return tokenizer.decode(out)


def main(argv: list[str]) -> None:
    from distrain.commands import helped, how
    from distrain.driver.jobargs import REQUIRED, Location, run_job

    if helped(argv, __doc__):
        return

    spec = {
        "run.name": (str, REQUIRED),
        "run.storage": (Location, "runs"),
        "prompt": (str, REQUIRED),
        "max_new_tokens": (int, 200),
        "temperature": (float, 0.8),
        "top_k": (int, 50),
        "seed": (int, 0),
        "step": (int, None),
        "device": (str, "auto"),
    }
    run_job(argv, spec, f"{how('generate')} {ARGUMENTS}", generate)
