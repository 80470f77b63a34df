"""The rules of `finetune.lora` (distrain/model/lora.py), checked in the driver before any worker starts: each
broken one a ConfigError of one line naming the key and the fix. Torch-free, as validation is."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from distrain.config import LORA_EXPERTS, LORA_GROUPS, LORA_PROJECTIONS, TrainConfig, to_plain
from distrain.model.size import linears, routed_experts
from distrain.strategy.parallelism import require

TARGETS = (*LORA_GROUPS, LORA_EXPERTS, *LORA_PROJECTIONS)


def validate(cfg: TrainConfig) -> None:
    lora, s = cfg.finetune.lora, cfg.strategy
    require(lora.rank >= 0, f"finetune.lora.rank={lora.rank}: give a positive rank (0: no adapters)")
    if lora.rank == 0:
        return
    require(lora.alpha > 0, f"finetune.lora.alpha={lora.alpha}: the adapters' scale is alpha / rank; give alpha > 0")
    require(0 <= lora.dropout < 1, f"finetune.lora.dropout={lora.dropout}: give a probability in [0, 1)")
    unknown = [t for t in lora.targets if t not in TARGETS]
    require(
        bool(lora.targets) and not unknown,
        f"finetune.lora.targets={list(lora.targets)}: {unknown or 'none'} unknown; name some of {', '.join(TARGETS)}",
    )
    require(
        cfg.ps.mode is None,
        f"finetune.lora with ps.mode={cfg.ps.mode}: the parameter server trains whole models; use strategy=ddp",
    )
    require(
        s.tp == 1 or s.tp_mode == "1d",
        f"finetune.lora with strategy.tp_mode={s.tp_mode}: adapters split only under 1-D tensor parallelism; "
        f"set strategy.tp_mode=1d",
    )
    require(
        s.ep == 1 or LORA_EXPERTS in lora.targets,
        f"finetune.lora with strategy.ep={s.ep}: the routed experts stay frozen without adapters of their own; add "
        f"{LORA_EXPERTS} to finetune.lora.targets, or set strategy.ep=1",
    )
    require(
        cfg.trainer.float8 == "none",
        f"finetune.lora with trainer.float8={cfg.trainer.float8}: torchao's Float8Linear would replace the adapted "
        f"layers and drop their adapters; set trainer.float8=none",
    )
    require(
        adapter_params(cfg) > 0,
        f"finetune.lora.targets={list(lora.targets)}: nothing in {cfg.model._target_}'s blocks is one of them "
        f"(layers.<i>.attention.<w>, layers.<i>.feed_forward.<w>, a MoE block's experts); name others",
    )


def base_fingerprint(cfg: TrainConfig) -> str | None:
    """A LoRA run's base model in 16 hex digits (None without adapters): its shape, and the bytes of model.init_from's
    weight files, else the seed its weights are drawn from. A checkpoint records it; a resume against another base
    (other weights in the same folder, another seed) is refused (rerun.claimed)."""
    if not cfg.finetune.lora.rank:
        return None
    model = {k: v for k, v in to_plain(cfg)["model"].items() if k not in ("name", "init_from")}
    digest = hashlib.sha256(json.dumps(model, sort_keys=True).encode())
    if cfg.model.init_from:
        weights = sorted(Path(cfg.model.init_from).glob("*.safetensors*"))
        for path in weights:
            stat = path.stat()
            digest.update(f"{path.name}:{_file_digest(str(path), stat.st_size, stat.st_mtime_ns)}".encode())
    else:
        digest.update(f"seed:{cfg.trainer.seed}".encode())
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=64)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """A file's SHA-256, read once per process for a given size and time of change."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def check_base(meta: dict, cfg: TrainConfig) -> None:
    """A checkpoint resumes only onto the base it adapted (and holds adapters only where this run trains them)."""
    saved = (meta.get("config") or {}).get("finetune", {}).get("lora", {"rank": 0})
    wanted = to_plain(cfg)["finetune"]["lora"]
    require(
        saved == wanted or not (saved.get("rank") or wanted["rank"]),
        f"run {cfg.run.name!r} was trained with finetune.lora={saved}, this config has {wanted}: resume with the same "
        f"adapters, or start a new run.name",
    )
    base = base_fingerprint(cfg)
    require(
        meta.get("base") == base,
        f"run {cfg.run.name!r}'s checkpoint adapts another base model (fingerprint {meta.get('base')}, this config's "
        f"{base}): resume with the model.init_from and trainer.seed it was trained on, or start a new run.name",
    )


def adapter_params(cfg: TrainConfig) -> int:
    """Parameters the adapters add, rank × (in + out) per adapted projection, and per expert for each of the three
    of routed experts: a shipped family's from its record, a user's model's built on the meta device (model/size.py)."""
    lora = cfg.finetune.lora
    if not lora.rank:
        return 0
    shapes = linears(cfg.model, cfg.trainer.seq_len)[0]
    found = sum(lora.rank * (fan_in + fan_out) for name, (fan_in, fan_out) in shapes.items() if lora.adapts(name))
    return found + expert_adapter_params(cfg)


def expert_adapter_params(cfg: TrainConfig) -> int:
    """The routed experts' adapters (finetune.lora.targets with experts): rank × (in + out) per expert on each of
    w1, w2 and w3."""
    lora, experts = cfg.finetune.lora, routed_experts(cfg.model, cfg.trainer.seq_len).items()
    return sum(3 * lora.rank * n * (dim + hidden) for name, (n, dim, hidden) in experts if lora.adapts(name))


def plan_lines(cfg: TrainConfig, total: int) -> list[str]:
    """--plan's line of a LoRA run: what trains and what stays frozen, of the model's `total` parameters."""
    lora = cfg.finetune.lora
    if not lora.rank:
        return []
    trained = adapter_params(cfg)
    return [
        f"finetune.lora: rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(lora.targets)}: {trained:,} parameters "
        f"trained ({100 * trained / (total + trained):.2f}%), {total:,} frozen (no gradient, no optimizer state)"
    ]
