"""Validation at the edge: every rule that can be checked before a worker starts, each broken
rule a one-line ConfigError naming the key and the fix. Fills the layout's open sizes on success."""

from __future__ import annotations

import copy
import os

from distrain.config import ClusterConfig, ConfigError, TrainConfig
from distrain.data.corpus import corpus_files
from distrain.layout import SCHEDULES, MeshSizes, micro_batches, num_stages

OPTIMIZERS = ("adamw", "sgd")
WANDB_MODES = (None, "online", "offline", "disabled")
PRECISIONS = ("auto", "fp32", "bf16")
PS_MODES = ("sync", "async", "hogwild", "easgd")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def mesh_sizes(cfg: TrainConfig) -> MeshSizes:
    s = cfg.strategy
    return MeshSizes.fill(cfg.cluster.num_workers, s.pp, s.dp_replicate, s.dp_shard, s.tp)


def dp_size(cfg: TrainConfig) -> int:
    """Data-parallel replicas: the workers left once tensor and pipeline dims are taken."""
    return mesh_sizes(cfg).dp


def resolve_layout(cfg: TrainConfig) -> None:
    """Fill what the strategy leaves open (-1 data-parallel dims, stages per rank) from the
    worker count, in place, so every worker and every record of the run sees concrete sizes."""
    s = cfg.strategy
    sizes = mesh_sizes(cfg)
    s.dp_replicate, s.dp_shard = sizes.dp_replicate, sizes.dp_shard
    if s.stages_per_rank is None:
        s.stages_per_rank = SCHEDULES[s.schedule].default_stages_per_rank if s.schedule in SCHEDULES else 1


def _validate_mesh(cfg: TrainConfig) -> None:
    s, n = cfg.strategy, cfg.cluster.num_workers
    for key, v in (("tp", s.tp), ("pp", s.pp)):
        _require(v >= 1, f"strategy.{key}={v}: must be at least 1")
    for key, v in (("dp_replicate", s.dp_replicate), ("dp_shard", s.dp_shard)):
        _require(v >= 1 or v == -1, f"strategy.{key}={v}: must be at least 1, or -1 for the workers left")
    _require(
        s.dp_replicate != -1 or s.dp_shard != -1,
        "strategy.dp_replicate and strategy.dp_shard are both -1; set one of them to a size",
    )
    fixed = s.pp * s.tp * max(s.dp_replicate, 1) * max(s.dp_shard, 1)
    if -1 in (s.dp_replicate, s.dp_shard):
        _require(
            n % fixed == 0,
            f"cluster.num_workers={n} is not divisible by strategy.pp × tp × the fixed data-parallel dim "
            f"= {fixed}; use a multiple of {fixed} workers",
        )
    else:
        _require(
            fixed == n,
            f"strategy.dp_replicate × dp_shard × tp × pp = {fixed} but cluster.num_workers={n}; "
            f"make them equal or set strategy.dp_replicate=-1",
        )


def _validate_parallelisms(cfg: TrainConfig) -> None:
    """The per-parallelism rules; runs after resolve_layout, so every size is concrete."""
    _validate_sharding(cfg)
    _validate_tensor_parallel(cfg)
    _validate_pipeline(cfg)
    _validate_compile_and_checkpointing(cfg)


def _validate_sharding(cfg: TrainConfig) -> None:
    s = cfg.strategy
    _require(s.zero in (0, 1, 2, 3), f"strategy.zero={s.zero}: choose 0 (DDP), 1, 2 or 3")
    _require(
        s.zero > 0 or s.dp_shard == 1,
        f"strategy.dp_shard={s.dp_shard} shards model state but strategy.zero=0 replicates it; "
        f"set strategy.zero to 1, 2 or 3, or strategy.dp_shard=1",
    )
    _require(
        s.zero == 0 or s.dp_shard > 1 or s.dp_replicate == 1,
        f"strategy.zero={s.zero} shards over strategy.dp_shard, which is 1 (dp_replicate={s.dp_replicate}); "
        f"set strategy.dp_shard=-1 and strategy.dp_replicate=1 (or a size for each, for HSDP), or strategy.zero=0",
    )
    _require(
        s.zero != 1 or (s.tp == 1 and s.pp == 1 and s.dp_replicate == 1),
        f"strategy.zero=1 (ZeroRedundancyOptimizer over DDP) is not supported with tp={s.tp}, pp={s.pp}, "
        f"dp_replicate={s.dp_replicate}: it needs a 1-D data-parallel mesh; use strategy.zero=2 or 3 to combine "
        f"sharding with other dims",
    )
    _require(
        not s.offload or (s.zero == 3 and s.tp == 1 and s.pp == 1),
        f"strategy.offload=true is not supported with zero={s.zero}, tp={s.tp}, pp={s.pp}: it needs "
        f"strategy.zero=3, tp=1, pp=1 (strategy=offload)",
    )


def _validate_tensor_parallel(cfg: TrainConfig) -> None:
    m, s, t = cfg.model, cfg.strategy, cfg.trainer
    if s.tp == 1:
        return
    sizes = {"n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads or m.n_heads, "ffn_dim": m.ffn_dim}
    sizes["vocab_size"] = m.vocab_size
    for key, v in sizes.items():
        _require(v % s.tp == 0, f"strategy.tp={s.tp} does not divide model.{key}={v}; choose a tp that divides it")
    _require(
        t.seq_len % s.tp == 0,
        f"strategy.tp={s.tp} does not divide trainer.seq_len={t.seq_len} (sequence parallelism shards it); "
        f"change one of them",
    )


def _validate_pipeline(cfg: TrainConfig) -> None:
    m, s, t = cfg.model, cfg.strategy, cfg.trainer
    _require(
        s.schedule in SCHEDULES,
        f"strategy.schedule={s.schedule!r} is not a known pipeline schedule; choose one of: {', '.join(SCHEDULES)}",
    )
    _require(s.stages_per_rank >= 1, f"strategy.stages_per_rank={s.stages_per_rank}: must be ≥ 1")
    if s.pp == 1:
        return
    multi = SCHEDULES[s.schedule].multi_stage
    _require(
        multi or s.stages_per_rank == 1,
        f"strategy.schedule={s.schedule} runs one stage per rank; set strategy.stages_per_rank=1 "
        f"or choose interleaved_1f1b",
    )
    stages = num_stages(s.pp, s.stages_per_rank)
    _require(
        stages <= m.n_layers,
        f"strategy.pp × stages_per_rank = {stages} stages but model.n_layers={m.n_layers}; "
        f"every stage needs a layer: lower strategy.pp or strategy.stages_per_rank",
    )
    n = micro_batches(t.global_batch_size, t.micro_batch_size, dp_size(cfg))
    _require(
        n >= s.pp and (not multi or n % s.pp == 0),
        f"strategy.schedule={s.schedule} on strategy.pp={s.pp} needs {'a multiple of ' if multi else ''}"
        f"at least {s.pp} micro-batches per step, but trainer.global_batch_size / (micro_batch_size × "
        f"data-parallel size) = {n}; raise trainer.global_batch_size or lower trainer.micro_batch_size",
    )


def _validate_compile_and_checkpointing(cfg: TrainConfig) -> None:
    """Combinations that crash inside torch 2.13 (each reproduced), refused before any worker starts."""
    s = cfg.strategy
    split = s.pp > 1 and SCHEDULES[s.schedule].split_backward
    for key, on in (("compile", s.compile), ("activation_checkpoint", s.activation_checkpoint)):
        _require(
            not (on and split),
            f"strategy.{key}=true is not supported with strategy.schedule={s.schedule} (its split backward pass "
            f"fails on it); choose another schedule or set strategy.{key}=false",
        )
    _require(
        not (s.compile and s.tp > 1),
        f"strategy.compile=true is not supported with strategy.tp={s.tp} (DTensor's backward fails under "
        f"compile); set strategy.compile=false",
    )
    _require(
        not (s.compile and s.activation_checkpoint),
        "strategy.compile=true is not supported with strategy.activation_checkpoint=true (the checkpoint's "
        "context cannot be traced); set one of them to false",
    )


def _validate_fault_tolerance(c: ClusterConfig) -> None:
    _require(c.max_failures >= -1, f"cluster.max_failures={c.max_failures}: must be ≥ 0, or -1 for no limit")
    _require(
        c.min_workers is None or 1 <= c.min_workers <= c.num_workers,
        f"cluster.min_workers={c.min_workers}: must be between 1 and cluster.num_workers={c.num_workers} (or null)",
    )
    for key in ("hang_timeout_s", "stop_grace_s"):
        value = getattr(c, key)
        _require(value is None or value > 0, f"cluster.{key}={value}: must be positive (or null for the default)")
    for key in ("setup_timeout_s", "node_check_s"):
        _require(getattr(c, key) > 0, f"cluster.{key}={getattr(c, key)}: must be positive")
    _require(c.restart_backoff_s >= 0, f"cluster.restart_backoff_s={c.restart_backoff_s}: must be ≥ 0")


def _validate_parameter_server(cfg: TrainConfig) -> None:
    """strategy.mode set: a parameter-server run. Fills alpha's default from the worker count."""
    s, n = cfg.strategy, cfg.cluster.num_workers
    if s.mode is None:
        return
    _require(
        s.mode in PS_MODES,
        f"strategy.mode={s.mode!r} is not a parameter-server mode; choose one of {', '.join(PS_MODES)}",
    )
    _require(s.num_servers >= 1, f"strategy.num_servers={s.num_servers}: need at least 1 parameter server")
    _require(
        s.tp == 1 and s.pp == 1 and s.zero == 0 and s.dp_shard == 1,
        f"strategy.mode={s.mode} (parameter server) is data-parallel only, but strategy.tp={s.tp}, pp={s.pp}, "
        f"zero={s.zero}, dp_shard={s.dp_shard}; use strategy=ps, or an all-reduce strategy without strategy.mode",
    )
    _require(
        0 <= s.backup_workers < n,
        f"strategy.backup_workers={s.backup_workers}: must be ≥ 0 and below cluster.num_workers={n} "
        f"(each step needs at least one gradient)",
    )
    _require(
        s.backup_workers == 0 or s.mode == "sync",
        f"strategy.backup_workers={s.backup_workers} applies to strategy.mode=sync only (mode is {s.mode})",
    )
    _require(
        s.max_staleness is None or (s.max_staleness >= 0 and s.mode == "async"),
        f"strategy.max_staleness={s.max_staleness}: must be ≥ 0, with strategy.mode=async only (mode is {s.mode})",
    )
    _require(s.tau >= 1, f"strategy.tau={s.tau}: EASGD takes at least 1 local step between exchanges")
    if s.alpha is None:
        s.alpha = 0.9 / n
    _require(0 < s.alpha < 1, f"strategy.alpha={s.alpha}: EASGD's elastic coefficient must be in (0, 1)")
    _require(
        cfg.cluster.min_workers is None,
        "cluster.min_workers does not apply to a parameter-server run: its workers are replaced one by one "
        "while the others go on; set cluster.min_workers=null",
    )


def smaller_layouts(cfg: TrainConfig) -> dict[int, TrainConfig]:
    """What a run may shrink to after losing nodes: for each worker count below cluster.num_workers,
    down to cluster.min_workers, whose layout validates with the same global batch (fewer workers
    take more gradient accumulation steps), the validated config; largest first. Call it on the
    config as composed, before `validate` fills its layout for num_workers."""
    c = cfg.cluster
    layouts = {}
    for n in range(c.num_workers - 1, (c.min_workers or c.num_workers) - 1, -1):
        trial = copy.deepcopy(cfg)
        trial.cluster.num_workers = n
        try:
            validate(trial)
        except ConfigError:
            continue
        layouts[n] = trial
    _require(
        bool(layouts) or (c.min_workers or c.num_workers) == c.num_workers,
        f"cluster.min_workers={c.min_workers} allows no layout smaller than {c.num_workers} workers: a run shrinks "
        f"by data-parallel replicas only (strategy.dp_replicate or dp_shard=-1), keeping strategy.tp × pp and a "
        f"trainer.global_batch_size they divide; change one of these or set cluster.min_workers=null",
    )
    return layouts


def validate(cfg: TrainConfig) -> None:
    """Check everything that can be checked without a cluster; raise ConfigError naming key and fix.
    Fills the layout's open sizes on success (resolve_layout)."""
    m, t, o, c = cfg.model, cfg.trainer, cfg.optim, cfg.cluster
    _require(c.num_workers >= 1, f"cluster.num_workers={c.num_workers}: need at least 1 worker")
    _validate_mesh(cfg)
    resolve_layout(cfg)
    _require(c.cpus_per_worker > 0, f"cluster.cpus_per_worker={c.cpus_per_worker}: must be positive")
    _require(c.threads_per_worker >= 1, f"cluster.threads_per_worker={c.threads_per_worker}: must be ≥ 1")
    _validate_fault_tolerance(c)

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
    _validate_parallelisms(cfg)
    _validate_parameter_server(cfg)
    _require(t.max_steps >= 1, f"trainer.max_steps={t.max_steps}: must be ≥ 1")
    _require(t.seq_len >= 2, f"trainer.seq_len={t.seq_len}: must be ≥ 2")
    _require(t.log_interval >= 1, f"trainer.log_interval={t.log_interval}: must be ≥ 1")
    _require(t.eval_batches >= 1, f"trainer.eval_batches={t.eval_batches}: must be ≥ 1")
    _require(
        t.straggler is None or 0 <= t.straggler < c.num_workers,
        f"trainer.straggler={t.straggler}: must be a rank below cluster.num_workers={c.num_workers} (or null)",
    )
    _require(t.straggler_slowdown >= 1, f"trainer.straggler_slowdown={t.straggler_slowdown}: must be ≥ 1")
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
