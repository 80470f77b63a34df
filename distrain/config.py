"""The typed configuration: one dataclass per Hydra group, validated once in the driver.

Hydra composes `conf/` on top of these schemas (so a misspelt key fails at composition),
`validate` checks what types cannot, and `to_plain` turns the result into the plain dict
that crosses into Ray actors, where `from_plain` rebuilds the dataclasses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from distrain.data.corpus import corpus_files


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the key and the fix."""


@dataclass
class ModelConfig:
    name: str = "nano"
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: as many as n_heads (no grouped-query attention)
    ffn_dim: int = 384
    vocab_size: int = 256  # byte-level tokens
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02


@dataclass
class StrategyConfig:
    name: str = "ddp"
    # Parallel dimensions; their product is the world size. -1 means "all the workers left".
    dp_replicate: int = -1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    bucket_cap_mb: float = 25.0


@dataclass
class DataConfig:
    name: str = "stdlib"  # a label for the corpus (runs, W&B); path decides what is read
    path: str | None = None  # a directory or glob of text files; None: the running Python's stdlib source
    val_fraction: float = 0.05


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | sgd
    lr: float = 3e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.0  # sgd only
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at decay_steps
    decay_steps: int | None = None  # the schedule's length; None: trainer.max_steps
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still logged)


@dataclass
class ClusterConfig:
    address: str | None = None  # None: RAY_ADDRESS if set, else an embedded local cluster
    num_workers: int = 2
    use_gpu: bool | None = None  # None: one GPU per worker if the cluster has GPUs
    cpus_per_worker: float = 0.25  # a fraction lets several CPU workers share a core
    threads_per_worker: int = 1
    placement_strategy: str = "PACK"
    placement_timeout_s: float = 120.0


@dataclass
class TrainerConfig:
    max_steps: int = 300
    global_batch_size: int = 32
    micro_batch_size: int = 8
    seq_len: int = 128
    seed: int = 0
    log_interval: int = 1
    eval_interval: int = 100  # 0 disables periodic validation (a final one still runs)
    eval_batches: int = 4
    precision: str = "auto"  # auto: bf16 autocast on GPU, fp32 on CPU | fp32 | bf16


@dataclass
class CheckpointConfig:
    interval: int = 100  # steps between checkpoints; 0: only at the end
    keep: int = 2  # committed checkpoints kept; older ones go only after a newer one commits


@dataclass
class WandbConfig:
    mode: str | None = None  # None: online with an API key, else offline | online | offline | disabled
    project: str = "distrain"
    entity: str | None = None


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress_interval_s: float = 5.0  # console progress line period when stdout is not a terminal


@dataclass
class RunConfig:
    name: str = "${model.name}-${strategy.name}-${now:%Y%m%d-%H%M%S}"
    storage: str = "runs"


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def run_dir(self) -> str:
        return os.path.join(self.run.storage, self.run.name)


ConfigStore.instance().store(name="train_schema", node=TrainConfig)

STRATEGIES = ("ddp",)
OPTIMIZERS = ("adamw", "sgd")
WANDB_MODES = (None, "online", "offline", "disabled")
PRECISIONS = ("auto", "fp32", "bf16")


def to_plain(cfg: Any) -> dict:
    """A resolved plain dict: what crosses into Ray actors (no Hydra or OmegaConf there)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def from_plain(d: dict) -> TrainConfig:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), d))


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def dp_size(cfg: TrainConfig) -> int:
    """Data-parallel replicas: the workers left once tensor, pipeline and sharding dims are taken."""
    s = cfg.strategy
    if s.dp_replicate > 0:
        return s.dp_replicate * s.dp_shard
    return cfg.cluster.num_workers // (s.tp * s.pp)


def validate(cfg: TrainConfig) -> None:
    """Check everything that can be checked without a cluster; raise ConfigError naming key and fix."""
    m, s, t, o, c = cfg.model, cfg.strategy, cfg.trainer, cfg.optim, cfg.cluster
    _require(c.num_workers >= 1, f"cluster.num_workers={c.num_workers}: need at least 1 worker")
    _require(
        s.name in STRATEGIES,
        f"strategy.name={s.name!r} is not a known strategy; choose one of: {', '.join(STRATEGIES)}",
    )
    if s.name == "ddp":
        _require(
            s.tp == 1 and s.pp == 1 and s.dp_shard == 1,
            f"strategy=ddp replicates the whole model: set strategy.tp=1, strategy.pp=1, strategy.dp_shard=1 "
            f"(got tp={s.tp}, pp={s.pp}, dp_shard={s.dp_shard})",
        )
    for key, v in (("dp_shard", s.dp_shard), ("tp", s.tp), ("pp", s.pp)):
        _require(v >= 1, f"strategy.{key}={v}: must be at least 1")
    dims = (s.dp_replicate if s.dp_replicate > 0 else 1) * s.dp_shard * s.tp * s.pp
    if s.dp_replicate > 0:
        _require(
            dims == c.num_workers,
            f"strategy.dp_replicate × dp_shard × tp × pp = {dims} but cluster.num_workers={c.num_workers}; "
            f"make them equal or set strategy.dp_replicate=-1",
        )
    else:
        _require(
            c.num_workers % dims == 0,
            f"cluster.num_workers={c.num_workers} is not divisible by dp_shard × tp × pp = {dims}",
        )
    _require(c.cpus_per_worker > 0, f"cluster.cpus_per_worker={c.cpus_per_worker}: must be positive")
    _require(c.threads_per_worker >= 1, f"cluster.threads_per_worker={c.threads_per_worker}: must be ≥ 1")

    _require(m.dim % m.n_heads == 0, f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}")
    _require((m.dim // m.n_heads) % 2 == 0, f"model.dim / model.n_heads = {m.dim // m.n_heads} must be even (rotary)")
    kv = m.n_kv_heads or m.n_heads
    _require(m.n_heads % kv == 0, f"model.n_kv_heads={kv} must divide model.n_heads={m.n_heads}")
    _require(m.vocab_size >= 256, f"model.vocab_size={m.vocab_size}: byte tokens need at least 256")

    dp = dp_size(cfg)
    per_step = t.micro_batch_size * dp
    _require(t.micro_batch_size >= 1, f"trainer.micro_batch_size={t.micro_batch_size}: must be ≥ 1")
    _require(
        t.global_batch_size % per_step == 0 and t.global_batch_size > 0,
        f"trainer.global_batch_size={t.global_batch_size} is not divisible by trainer.micro_batch_size × "
        f"data-parallel size = {t.micro_batch_size} × {dp} = {per_step}; use a multiple of {per_step}",
    )
    _require(t.max_steps >= 1, f"trainer.max_steps={t.max_steps}: must be ≥ 1")
    _require(t.seq_len >= 2, f"trainer.seq_len={t.seq_len}: must be ≥ 2")
    _require(t.log_interval >= 1, f"trainer.log_interval={t.log_interval}: must be ≥ 1")
    _require(t.eval_batches >= 1, f"trainer.eval_batches={t.eval_batches}: must be ≥ 1")
    _require(t.precision in PRECISIONS, f"trainer.precision={t.precision!r}: choose one of {', '.join(PRECISIONS)}")

    _require(o.name in OPTIMIZERS, f"optim.name={o.name!r}: choose one of {', '.join(OPTIMIZERS)}")
    _require(o.lr > 0, f"optim.lr={o.lr}: must be positive")
    _require(o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps}: must be ≥ 0")
    _require(
        o.decay_steps is None or o.decay_steps > o.warmup_steps,
        f"optim.decay_steps={o.decay_steps} must exceed optim.warmup_steps={o.warmup_steps} (or be null)",
    )
    _require(o.grad_clip >= 0, f"optim.grad_clip={o.grad_clip}: must be ≥ 0 (0 disables clipping)")

    _require(cfg.checkpoint.interval >= 0, f"checkpoint.interval={cfg.checkpoint.interval}: must be ≥ 0")
    _require(cfg.checkpoint.keep >= 1, f"checkpoint.keep={cfg.checkpoint.keep}: keep at least 1 checkpoint")
    _require(
        cfg.logger.wandb.mode in WANDB_MODES,
        f"logger.wandb.mode={cfg.logger.wandb.mode!r}: choose online, offline or disabled",
    )
    _require(0 < cfg.data.val_fraction < 1, f"data.val_fraction={cfg.data.val_fraction}: must be in (0, 1)")
    files = corpus_files(cfg.data.path)
    _require(
        bool(files), f"data.path={cfg.data.path!r} matches no files; give an existing directory or glob of text files"
    )
    val_tokens = int(sum(os.path.getsize(f) for f in files) * cfg.data.val_fraction)
    _require(
        val_tokens > t.seq_len + 1,
        f"data.path={cfg.data.path!r} leaves {val_tokens} bytes for validation (data.val_fraction="
        f"{cfg.data.val_fraction:g}), too few for trainer.seq_len={t.seq_len}; add text or lower trainer.seq_len",
    )
    _require(bool(cfg.run.name) and "/" not in cfg.run.name, f"run.name={cfg.run.name!r}: must be a plain name")
