"""Validation at the edge: every rule that can be checked before a worker starts, each broken rule a
one-line ConfigError naming the key and the fix. It only checks: the config is never changed, and
what the strategy leaves open is resolved into the `Layout` it returns."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from typing import Any

from distrain.config import ClusterConfig, ConfigError, TrainConfig, attach_address
from distrain.data.checks import check_data
from distrain.data.corpus import corpus_files
from distrain.driver import finetune, optim_rules
from distrain.driver.plan import rank_memory
from distrain.model.families import shipped
from distrain.model.registry import check_model, has_causal_attention, has_plan
from distrain.ps import rules as parameter_server
from distrain.storage import directio
from distrain.strategy import PARALLELISMS, float8
from distrain.strategy.layout import Layout
from distrain.strategy.parallelism import require
from distrain.strategy.pipeline import SCHEDULES
from distrain.strategy.resolve import resolve, smaller
from distrain.urls import check_location, is_url, looks_like_url

WANDB_MODES = (None, "online", "offline", "disabled")
TENSORBOARD_HINT = 'pip install -e ".[tensorboard]"'  # logger.tensorboard's package
PRECISIONS = ("auto", "fp32", "bf16")
OFFLOADS = ("none", "cpu", "nvme")
OBJECTIVES = ("val_loss", "loss")  # run.objective: summary.json's final_<objective>
# What WorkerGroup.environments sets for each rank (distrain/cluster/worker_group.py).
PER_RANK_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
    "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
)  # fmt: skip


def validate(cfg: TrainConfig) -> Layout:
    """Check everything that can be checked without a cluster; raise ConfigError naming key and fix.
    Returns the run's layout on cluster.num_workers."""
    _validate_places(cfg)
    layout = resolve(cfg)
    _validate_numbers(cfg)
    _validate_model(cfg)
    finetune.validate(cfg)
    for parallelism in reversed(PARALLELISMS):
        parallelism.validate(cfg)
    _validate_offload_compile_and_checkpointing(cfg)
    _validate_nvme(cfg, layout)
    _validate_cluster(cfg.cluster)
    _validate_elastic(cfg, layout)
    parameter_server.validate(cfg)
    _validate_training(cfg)
    float8.validate(cfg)
    _validate_data(cfg)
    return layout


def _validate_places(cfg: TrainConfig) -> None:
    """A URL is never taken for a local path (distrain/urls.py), and storage.cache_dir is each node's own folder."""
    for key, text in (("run.storage", cfg.run.storage), ("data.shards", cfg.data.shards)):
        try:
            check_location(text or "", key)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    require(
        not looks_like_url(cfg.storage.cache_dir),
        f"storage.cache_dir={cfg.storage.cache_dir!r} is a URL: it is each node's own local folder; give a path",
    )


def _validate_model(cfg: TrainConfig) -> None:
    """The model's target keeps the contract (a user's is imported and built on the meta device), and
    its shape works for its family."""
    m, t = cfg.model, cfg.trainer
    check_model(m, t.seq_len)
    family = shipped(m._target_)
    if family is not None and not family.head_options:
        require(
            m.head_dim is None and not m.qk_norm,
            f"model.head_dim={m.head_dim} model.qk_norm={m.qk_norm}: the family {m._target_} has neither a head "
            f"width of its own nor per-head norms of Q and K; set model.head_dim=null model.qk_norm=false",
        )
    if m.head_dim is None:
        require(m.dim % m.n_heads == 0, f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}")
    if family is not None and family.rotary:
        width = m.head_width()
        said = f"model.head_dim={width}" if m.head_dim is not None else f"model.dim / model.n_heads = {width}"
        require(width > 0 and width % 2 == 0, f"{said} must be even and positive (rotary)")
    if family is not None and family.check is not None:
        family.check(m)
    kv = m.n_kv_heads or m.n_heads
    require(m.n_heads % kv == 0, f"model.n_kv_heads={kv} must divide model.n_heads={m.n_heads}")
    require(m.vocab_size >= 256, f"model.vocab_size={m.vocab_size}: byte tokens need at least 256")
    require(
        m.n_positions is None or t.seq_len <= m.n_positions,
        f"trainer.seq_len={t.seq_len} exceeds model.n_positions={m.n_positions} (the learned positions' table); "
        f"lower trainer.seq_len or raise model.n_positions",
    )
    s = cfg.strategy
    if s.tp > 1:
        require(
            has_plan(m, t.seq_len, s.tp_mode),
            f"strategy.tp={s.tp} strategy.tp_mode={s.tp_mode}: model {m.name} ({m._target_}, tie_embeddings="
            f"{m.tie_embeddings}, qk_norm={m.qk_norm}) has no plan for it; "
            + ("use strategy.tp_mode=1d" if s.tp_mode != "1d" else "use a strategy without tensor parallelism"),
        )
    if s.cp > 1:
        require(
            has_causal_attention(m, t.seq_len),
            f"strategy.cp={s.cp}: model {m.name} ({m._target_}) computes its attention outside "
            f"distrain.model.common.CausalAttention, which context parallelism splits (docs/models.md); use it, "
            f"or strategy.cp=1",
        )
    if s.tp > 1 and s.tp_mode == "1d" and family is not None and family.learned_positions:  # split over its rows
        rows = m.n_positions or t.seq_len
        require(
            rows % s.tp == 0,
            f"strategy.tp={s.tp} does not divide model.n_positions={rows}; choose a tp that divides it",
        )


def _validate_offload_compile_and_checkpointing(cfg: TrainConfig) -> None:
    """Offload's prerequisites, and combinations that crash inside torch 2.13 (each reproduced),
    refused before any worker starts."""
    s = cfg.strategy
    require(s.offload in OFFLOADS, f"strategy.offload={s.offload!r}: choose none, cpu (what true meant) or nvme")
    require(
        s.offload == "none" or (s.zero == 3 and s.tp == 1 and s.pp == 1),
        f"strategy.offload={s.offload} is not supported with zero={s.zero}, tp={s.tp}, pp={s.pp}: it needs "
        f"strategy.zero=3, tp=1, pp=1 (strategy=offload or strategy=nvme)",
    )
    split = s.pp > 1 and SCHEDULES[s.schedule].split_backward
    for key, on in (("compile", s.compile), ("activation_checkpoint", s.activation_checkpoint)):
        require(
            not (on and split),
            f"strategy.{key}=true is not supported with strategy.schedule={s.schedule} (its split backward pass "
            f"fails on it); choose another schedule or set strategy.{key}=false",
        )
    require(
        not (s.compile and s.tp > 1),
        f"strategy.compile=true is not supported with strategy.tp={s.tp} (DTensor's backward fails under "
        f"compile); set strategy.compile=false",
    )
    require(
        not (s.compile and s.activation_checkpoint),
        "strategy.compile=true is not supported with strategy.activation_checkpoint=true (the checkpoint's "
        "context cannot be traced); set one of them to false",
    )


def _validate_nvme(cfg: TrainConfig, layout: Layout) -> None:
    """NVMe offload's optimizer, host buffers and disk. The disk is checked on this machine: the whole
    run's when the cluster is embedded here; on a cluster it is attached to, the ranks' nodes are not
    known yet and each rank checks its own as it starts."""
    s = cfg.strategy
    if s.offload != "nvme":
        return
    require(
        cfg.optim.name == "adamw",
        f"strategy.offload=nvme streams AdamW's moments, but optim.name={cfg.optim.name}: use optim=adamw, or "
        f"strategy.offload=cpu",
    )
    pool = int(s.nvme_buffer_mb * 2**20)
    require(
        directio.chunk_bytes(pool, 2) > 0,
        f"strategy.nvme_buffer_mb={s.nvme_buffer_mb:g} is too small for one chunk: the stream needs "
        f"{directio.BUFFERS} buffers, each a chunk of AdamW's two moments of at least "
        f"{directio.MIN_CHUNK_BYTES // 1024} KiB each; set it to at least {directio.min_pool_bytes(2) / 2**20:g}",
    )
    ranks_here = 0 if attach_address(cfg.cluster.address) else layout.world_size
    need = ranks_here * rank_memory(cfg, layout, 0, "fp32").optimizer
    root = os.path.dirname(s.nvme_directory(cfg.run.name))
    trouble = directio.problem(root, need)
    require(trouble is None, f"strategy.nvme_path: {trouble}")


def _validate_cluster(c: ClusterConfig) -> None:
    require(c.cpus_per_worker > 0, f"cluster.cpus_per_worker={c.cpus_per_worker}: must be positive")
    require(c.threads_per_worker >= 1, f"cluster.threads_per_worker={c.threads_per_worker}: must be ≥ 1")
    for key in ("local_cpus", "local_gpus"):
        value = getattr(c, key)
        require(value is None or value >= 0, f"cluster.{key}={value}: must be ≥ 0 (or null for the machine's)")
    require(c.spares >= 0, f"cluster.spares={c.spares}: must be ≥ 0")
    require(c.max_failures >= -1, f"cluster.max_failures={c.max_failures}: must be ≥ 0, or -1 for no limit")
    require(
        c.min_workers is None or 1 <= c.min_workers <= c.num_workers,
        f"cluster.min_workers={c.min_workers}: must be between 1 and cluster.num_workers={c.num_workers} (or null)",
    )
    for key in ("hang_timeout_s", "stop_grace_s"):
        value = getattr(c, key)
        require(value is None or value > 0, f"cluster.{key}={value}: must be positive (or null for the default)")
    for key in ("setup_timeout_s", "collective_timeout_s", "node_check_s", "connect_timeout_s"):
        require(getattr(c, key) > 0, f"cluster.{key}={getattr(c, key)}: must be positive")
    require(c.restart_backoff_s >= 0, f"cluster.restart_backoff_s={c.restart_backoff_s}: must be ≥ 0")
    for key in c.env_vars:
        require(
            key not in PER_RANK_VARIABLES,
            f"cluster.env_vars.{key}: distrain sets {key} for each worker itself"
            + ("; use cluster.threads_per_worker" if key == "OMP_NUM_THREADS" else ""),
        )


def _validate_elastic(cfg: TrainConfig, layout: Layout) -> None:
    c = cfg.cluster
    require(
        (c.min_workers or c.num_workers) == c.num_workers or bool(smaller(layout, cfg)),
        f"cluster.min_workers={c.min_workers} allows no layout smaller than {c.num_workers} workers: a run shrinks "
        f"by data-parallel replicas only (strategy.dp_replicate or dp_shard=-1), keeping strategy.tp × pp and a "
        f"trainer.global_batch_size they divide; change one of these or set cluster.min_workers=null",
    )


def _validate_numbers(cfg: Any, prefix: str = "") -> None:
    """Every setting is a finite number: optim.lr=inf trains to NaN at its first steps, an infinite timeout fails
    in every rank where it becomes a timedelta (a large one means no limit), and `nan > 0` is false where a rule
    below would call it not positive."""
    for f in dataclasses.fields(cfg):
        key, value = prefix + f.name, getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            _validate_numbers(value, key + ".")
        elif isinstance(value, float):
            require(math.isfinite(value), f"{key}={value}: must be a finite number")


def _validate_training(cfg: TrainConfig) -> None:
    t, f, n = cfg.trainer, cfg.fault, cfg.cluster.num_workers
    require(t.max_steps >= 1, f"trainer.max_steps={t.max_steps}: must be ≥ 1")
    require(t.seq_len >= 2, f"trainer.seq_len={t.seq_len}: must be ≥ 2")
    require(t.log_interval >= 1, f"trainer.log_interval={t.log_interval}: must be ≥ 1")
    require(t.eval_batches >= 1, f"trainer.eval_batches={t.eval_batches}: must be ≥ 1")
    require(t.loss_chunk >= 0, f"trainer.loss_chunk={t.loss_chunk}: must be ≥ 0 (0: the loss over all tokens at once)")
    require(t.precision in PRECISIONS, f"trainer.precision={t.precision!r}: choose one of {', '.join(PRECISIONS)}")
    require(
        f.straggler is None or 0 <= f.straggler < n,
        f"fault.straggler={f.straggler}: must be a rank below cluster.num_workers={n} (or null)",
    )
    require(f.straggler_slowdown >= 1, f"fault.straggler_slowdown={f.straggler_slowdown}: must be ≥ 1")
    require(f.slow_return_s >= 0, f"fault.slow_return_s={f.slow_return_s}: must be ≥ 0")
    require(0 <= f.kill_rank < n, f"fault.kill_rank={f.kill_rank}: must be a rank below cluster.num_workers={n}")
    require(
        f.kill_at_step is None or (1 <= f.kill_at_step <= t.max_steps and cfg.ps.mode is None),
        f"fault.kill_at_step={f.kill_at_step}: must be a step of trainer.max_steps={t.max_steps} in collective "
        "training (or null)",
    )
    require(
        not f.kill_mid_upload
        or (
            f.kill_at_step is not None
            and is_url(cfg.run.storage)
            and (f.kill_at_step == t.max_steps or f.kill_at_step % (cfg.checkpoint.interval or t.max_steps + 1) == 0)
        ),
        "fault.kill_mid_upload=true: needs run.storage on an object store (a URL) and fault.kill_at_step at a "
        "step that saves a checkpoint (a multiple of checkpoint.interval, or trainer.max_steps)",
    )
    require(
        f.kill_at_step is not None or not (f.kill_after_backward or f.fail_in_update),
        "fault.kill_after_backward and fault.fail_in_update say where fault.kill_at_step's fault happens: set "
        "fault.kill_at_step too",
    )
    require(
        f.kill_mid_upload + f.kill_after_backward + f.fail_in_update <= 1,
        "fault.kill_mid_upload, fault.kill_after_backward and fault.fail_in_update each put fault.kill_at_step's "
        "fault somewhere else: set one of them",
    )
    optim_rules.validate(cfg)
    require(cfg.checkpoint.interval >= 0, f"checkpoint.interval={cfg.checkpoint.interval}: must be ≥ 0")
    require(cfg.checkpoint.keep >= 1, f"checkpoint.keep={cfg.checkpoint.keep}: keep at least 1 checkpoint")
    require(
        cfg.logger.wandb.mode in WANDB_MODES,
        f"logger.wandb.mode={cfg.logger.wandb.mode!r}: choose online, offline or disabled",
    )
    require(
        not cfg.logger.tensorboard or importlib.util.find_spec("tensorboard") is not None,
        f"logger.tensorboard=true needs the tensorboard package, which is not installed: {TENSORBOARD_HINT}",
    )
    require(bool(cfg.run.name) and "/" not in cfg.run.name, f"run.name={cfg.run.name!r}: must be a plain name")
    require(cfg.run.objective in OBJECTIVES, f"run.objective={cfg.run.objective!r}: choose val_loss or loss")


def _validate_data(cfg: TrainConfig) -> None:
    d, t = cfg.data, cfg.trainer
    check_data(cfg)
    if d.shards:
        return
    require(0 < d.val_fraction < 1, f"data.val_fraction={d.val_fraction}: must be in (0, 1)")
    files = corpus_files(d.path)
    require(bool(files), f"data.path={d.path!r} matches no files; give an existing directory or glob of text files")
    val_tokens = int(sum(os.path.getsize(f) for f in files) * d.val_fraction)
    require(
        val_tokens > t.seq_len + 1,
        f"data.path={d.path!r} leaves {val_tokens} bytes for validation (data.val_fraction="
        f"{d.val_fraction:g}), too few for trainer.seq_len={t.seq_len}; add text or lower trainer.seq_len",
    )
