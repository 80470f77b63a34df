"""Hugging Face interop: a `config.json` ↔ a distrain `ModelConfig`, and HF tensor names ↔ distrain's,
for each shipped family whose record names a counterpart (families/: `Family.hf`). Anything the
distrain model would compute differently (rope scaling, biases, another activation, ...) is refused
with a one-line ConfigError rather than loaded wrong.

A family's table of `Rule`s says where each distrain parameter lives in the HF file, and serves both
directions: `hf_weights` reads one tensor at a time (safetensors' `safe_open`, sharded files included)
for `contract.fill_parameters`, so every layout loads only what it keeps; `to_hf` turns a whole state
dict into HF's. A rule also says how a layout differs beyond names: stored transposed (GPT-2's Conv1D),
fused along rows (GPT-2's Q, K, V), rows permuted per head (Llama's rotary halves; Qwen3's per-head gains
within the head), one expert's slice of distrain's stacked experts (Mixtral's and Qwen3-MoE's tensor per expert).

The driver imports this module (`resolve_init_from`): torch is imported only where tensors are read.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from distrain.config import ConfigError, ModelConfig, TrainConfig
from distrain.model.families import FAMILIES, shipped
from distrain.model.families.family import HFMapping, Rule

if TYPE_CHECKING:
    import torch

# Each HF architecture distrain reads: (the family's model._target_, its mapping).
ARCHITECTURES = {m.architecture: (f.target, m) for f in FAMILIES.values() for m in f.hf}
INDEX_FILE, WEIGHTS_FILE = "model.safetensors.index.json", "model.safetensors"


def _refuse(directory: str | Path, what: str, fix: str) -> None:
    raise ConfigError(f"model.init_from={directory}: {what}; {fix}")


def model_config(directory: str | Path, base: ModelConfig) -> ModelConfig:
    """The distrain model a Hugging Face config.json describes (`base` keeps what HF does not say:
    init_std); a ConfigError for an architecture or option distrain's model would compute differently."""
    try:
        hf = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError) as e:
        _refuse(directory, f"no readable config.json ({type(e).__name__})", "give a Hugging Face model directory")
    arch = (hf.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        _refuse(directory, f"architecture {arch!r} is not supported", f"use one of {', '.join(ARCHITECTURES)}")
    target, mapping = ARCHITECTURES[arch]
    try:
        _check_options(directory, hf, mapping.unsupported(hf))
        shape = mapping.shape(hf)
    except KeyError as e:
        _refuse(directory, f"its config.json has no {e}", f"save it with transformers' {arch}")
    if "moe" in shape:  # the experts' shape; the rest of model.moe (balancing, ...) as the run sets it
        shape["moe"] = dataclasses.replace(base.moe, **shape["moe"])
    return dataclasses.replace(
        base, _target_=target, name=Path(directory).name, init_from=os.path.abspath(directory), **shape
    )


def _check_options(directory: str | Path, hf: dict, unsupported: dict[str, tuple[bool, str]]) -> None:
    for key, (bad, wanted) in unsupported.items():  # (set to what distrain cannot compute, what it must be)
        if bad:
            _refuse(directory, f"{key}={hf.get(key)!r} is not supported by distrain's model", f"it must be {wanted}")


def resolve_init_from(cfg: TrainConfig, say: Callable[[str], None] = print) -> TrainConfig:
    """In the driver, before validation: with model.init_from, the model's family, shape and vocabulary
    come from the directory's config.json (said in one line); its weights are checked to be there. The
    path is made absolute: the workers read it (on a cluster, from storage every node shares)."""
    directory = cfg.model.init_from
    if not directory:
        return cfg
    model = model_config(directory, cfg.model)
    if not (Path(directory) / INDEX_FILE).is_file() and not (Path(directory) / WEIGHTS_FILE).is_file():
        _refuse(directory, f"neither {WEIGHTS_FILE} nor {INDEX_FILE}", "save the model with safetensors")
    keys = ("_target_", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "tie_embeddings")
    keys += tuple(k for k in ("head_dim", "qk_norm") if getattr(model, k))  # Qwen3's, where set
    settings = " ".join(f"model.{k}={getattr(model, k)}" for k in keys)
    say(f"distrain: model.init_from={directory}: {settings} (from its config.json; its weights load once laid out)")
    return dataclasses.replace(cfg, model=model)


def hf_mapping(cfg: ModelConfig) -> HFMapping:
    """The family's counterpart for cfg: the one whose attention norms Q and K per head as model.qk_norm says."""
    family = shipped(cfg._target_)
    fits = [m for m in (family.hf if family is not None else ()) if m.qk_norm == cfg.qk_norm]
    if not fits:
        names = " and ".join(dict.fromkeys(target for target, _ in ARCHITECTURES.values()))
        with_it = f" with model.qk_norm={cfg.qk_norm}" if family is not None else ""
        raise ConfigError(f"model._target_={cfg._target_} has no Hugging Face counterpart{with_it}: only {names}")
    return fits[0]


def _rope_rows(t: torch.Tensor, heads: int, to_hf: bool) -> torch.Tensor:
    """Per head, HF's row order (first half, second half) ↔ distrain's (pairs (j, j + head_dim/2) adjacent)."""
    grouped = t.unflatten(0, (heads, 2, -1) if not to_hf else (heads, -1, 2))
    return grouped.transpose(1, 2).flatten(0, 2)


def hf_rows(rule: Rule, t: torch.Tensor) -> torch.Tensor:
    """Rows of distrain's order (a weight's, a LoRA B's) in the HF tensor's: permuted per head where the rule says."""
    return _rope_rows(t, rule.heads, to_hf=True) if rule.heads else t


def _to_distrain(rule: Rule, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if rule.conv1d and t.dim() == 2:
        t = t.t()
    if rule.heads:
        t = _rope_rows(t, rule.heads, to_hf=False)
    return t.chunk(len(rule.names)) if len(rule.names) > 1 else (t,)


def _to_hf(rule: Rule, parts: list[torch.Tensor]) -> torch.Tensor:
    import torch

    t = hf_rows(rule, torch.cat(parts) if len(parts) > 1 else parts[0])
    return (t.t() if rule.conv1d and t.dim() == 2 else t).contiguous()


class _Files:
    """The directory's safetensors, one tensor read at a time; files saved from the bare base model (as
    GPT-2's original checkpoints are) name tensors without `bare_prefix`."""

    def __init__(self, directory: str | Path, bare_prefix: str):
        d = Path(directory)
        if (d / INDEX_FILE).is_file():
            self.where = {k: d / f for k, f in json.loads((d / INDEX_FILE).read_text())["weight_map"].items()}
        else:
            from safetensors import safe_open

            with safe_open(str(d / WEIGHTS_FILE), "pt") as f:
                self.where = {k: d / WEIGHTS_FILE for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
        self.directory, self.bare_prefix = directory, bare_prefix

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        stored = name if name in self.where else name.removeprefix(self.bare_prefix)
        if stored not in self.where:
            _refuse(self.directory, f"its weights have no tensor {name!r}", "export the whole model")
        with safe_open(str(self.where[stored]), "pt") as f:
            return f.get_tensor(stored)


def hf_weights(directory: str | Path, cfg: ModelConfig) -> Callable[[str, torch.Size], torch.Tensor]:
    """`value_of(name, shape)` for contract.fill_parameters: distrain parameter `name`'s full value read
    from the HF directory (only the tensor holding it), as float32."""
    import torch

    mapping = hf_mapping(cfg)
    files, by_name = _Files(directory, mapping.bare_prefix), {}
    for rule in mapping.rules(cfg):
        for index, name in enumerate(rule.names):
            by_name.setdefault(name, []).append((rule, index))  # several: one expert's slice each, in order
    if cfg.tie_embeddings:
        by_name["output.weight"] = by_name["tok_embeddings.weight"]

    def value_of(name: str, shape: torch.Size) -> torch.Tensor:
        if name not in by_name:
            _refuse(directory, f"distrain parameter {name!r} has no Hugging Face counterpart", "check model._target_")
        held = sorted(by_name[name], key=lambda h: h[0].expert or 0)  # an expert's slice at its place
        pieces = [_to_distrain(r, files.get(r.hf).float())[i] for r, i in held]
        rule = held[0][0]
        value = torch.stack(pieces) if rule.expert is not None else pieces[0]
        if value.shape != shape:
            _refuse(directory, f"{rule.hf} gives {name} shape {tuple(value.shape)}, not {tuple(shape)}", "re-save it")
        return value

    return value_of


def to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A whole distrain state dict (full tensors) as the HF model's tensors (a tied head left out, as
    `save_pretrained` does)."""

    def parts(rule: Rule) -> list[torch.Tensor]:
        return [state[n] if rule.expert is None else state[n][rule.expert] for n in rule.names]

    return {rule.hf: _to_hf(rule, parts(rule)) for rule in hf_mapping(cfg).rules(cfg)}


def hf_config(cfg: ModelConfig, max_seq_len: int) -> dict:
    """The config.json of cfg's HF counterpart (float32 weights), trained on sequences of max_seq_len."""
    mapping = hf_mapping(cfg)
    common = {"vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings, "dtype": "float32"}
    return common | {"architectures": [mapping.architecture]} | mapping.config(cfg, max_seq_len)
