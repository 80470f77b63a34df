"""The optimizer's rules (optim.*), which driver/validation.py checks with the rest: each broken one a line naming
the key and the fix."""

from __future__ import annotations

from distrain.config import TrainConfig
from distrain.strategy.parallelism import require

OPTIMIZERS = ("adamw", "sgd", "muon")
MUON_PARAMS = ("blocks", "matrices")


def validate(cfg: TrainConfig) -> None:
    o = cfg.optim
    require(o.name in OPTIMIZERS, f"optim.name={o.name!r}: choose one of {', '.join(OPTIMIZERS)}")
    require(o.lr > 0, f"optim.lr={o.lr}: must be positive")
    require(o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps}: must be ≥ 0")
    require(
        o.decay_steps is None or o.decay_steps > o.warmup_steps,
        f"optim.decay_steps={o.decay_steps} must exceed optim.warmup_steps={o.warmup_steps} (or be null)",
    )
    require(o.grad_clip >= 0, f"optim.grad_clip={o.grad_clip}: must be ≥ 0 (0 disables clipping)")
    if o.name == "muon":
        _validate_muon(cfg)


def _validate_muon(cfg: TrainConfig) -> None:
    """Muon orthogonalises each matrix whole: a layout whose pieces of a matrix are not a DTensor's cannot."""
    o, s = cfg.optim, cfg.strategy
    require(o.ns_steps >= 1, f"optim.ns_steps={o.ns_steps}: must be ≥ 1")
    require(o.muon_params in MUON_PARAMS, f"optim.muon_params={o.muon_params!r}: choose blocks or matrices")
    require(
        cfg.ps.mode is None,
        "optim=muon needs whole matrices, and the parameter server's shards are slices of them: use optim=adamw",
    )
    require(
        s.tp == 1 or s.tp_mode == "1d",
        f"optim=muon needs whole matrices, and strategy.tp_mode={s.tp_mode} splits them into blocks it cannot "
        "gather: use strategy.tp_mode=1d, or optim=adamw",
    )
