"""The parameter server's rules for a config, beside the parameter server as each parallelism's rules sit in
its record (distrain/strategy/): driver/validation.py calls `validate` with the rest. Torch-free: the driver
validates without importing torch."""

from __future__ import annotations

from distrain.config import TrainConfig
from distrain.strategy.parallelism import require

PS_MODES = ("sync", "async", "hogwild", "easgd")


def validate(cfg: TrainConfig) -> None:
    """ps.mode set: a parameter-server run; ConfigError naming the key and the fix for a broken rule."""
    p, s, n = cfg.ps, cfg.strategy, cfg.cluster.num_workers
    if p.mode is None:
        return
    require(
        p.mode in PS_MODES, f"ps.mode={p.mode!r} is not a parameter-server mode; choose one of {', '.join(PS_MODES)}"
    )
    require(p.num_servers >= 1, f"ps.num_servers={p.num_servers}: need at least 1 parameter server")
    require(
        s.tp == 1 and s.pp == 1 and s.zero == 0 and s.dp_shard == 1,
        f"ps.mode={p.mode} (parameter server) is data-parallel only, but strategy.tp={s.tp}, pp={s.pp}, "
        f"zero={s.zero}, dp_shard={s.dp_shard}; use strategy=ps, or an all-reduce strategy with ps=none",
    )
    require(
        0 <= p.backup_workers < n,
        f"ps.backup_workers={p.backup_workers}: must be ≥ 0 and below cluster.num_workers={n} "
        f"(each step needs at least one gradient)",
    )
    require(
        p.backup_workers == 0 or p.mode == "sync",
        f"ps.backup_workers={p.backup_workers} applies to ps.mode=sync only (mode is {p.mode})",
    )
    require(
        p.max_staleness is None or (p.max_staleness >= 0 and p.mode == "async"),
        f"ps.max_staleness={p.max_staleness}: must be ≥ 0, with ps.mode=async only (mode is {p.mode})",
    )
    require(p.tau >= 1, f"ps.tau={p.tau}: EASGD takes at least 1 local step between exchanges")
    alpha = p.elastic_alpha(n)
    require(0 < alpha < 1, f"ps.alpha={alpha}: EASGD's elastic coefficient must be in (0, 1)")
    require(
        cfg.cluster.min_workers is None,
        "cluster.min_workers does not apply to a parameter-server run: its workers are replaced one by one "
        "while the others go on; set cluster.min_workers=null",
    )
