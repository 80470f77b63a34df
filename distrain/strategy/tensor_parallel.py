"""Tensor parallelism as the driver sees it: 1-D (Megatron) on one `tp` dim, or 2-D, 2.5-D and 3-D on a grid
that reshapes it; the model shapes each mode can split, its plan section (who holds which block) and how
it splits weights and activations. Applied by distrain/parallel/tensor_parallel.py."""

from __future__ import annotations

from typing import Any

from distrain.config import TrainConfig
from distrain.strategy.layout import Layout
from distrain.strategy.parallelism import Parallelism, require
from distrain.strategy.pipeline import SCHEDULES

TP_MODES = ("1d", "2d", "2.5d", "3d")


def _root(n: int, k: int) -> int | None:
    """The integer k-th root of n, if n is a k-th power."""
    r = round(n ** (1 / k))
    return next((c for c in (r - 1, r, r + 1) if c >= 1 and c**k == n), None)


def tp_grid(mode: str, tp: int, depth: int = 1) -> tuple[tuple[str, int], ...]:
    """The tensor-parallel sub-mesh: its dims (outermost first) and sizes, whose product is tp. The
    ranks keep their row-major order, so the grid is a reshape of the one `tp` dim. 3d's names are the
    indices of Y_ij = Σ_k X_ik W_kj, its batch axis i innermost (distrain/parallel/tpnd/cube.py)."""
    require(mode in TP_MODES, f"strategy.tp_mode={mode!r} is not a tensor-parallel mode; choose one of: "
            f"{', '.join(TP_MODES)}")  # fmt: skip
    require(depth >= 1, f"strategy.tp_depth={depth}: must be at least 1")
    require(depth == 1 or mode == "2.5d", f"strategy.tp_depth={depth} is for strategy.tp_mode=2.5d only")
    if mode == "1d":
        return (("tp", tp),)
    if mode == "3d":
        q = _root(tp, 3)
        require(q is not None, f"strategy.tp={tp} is not a cube; tp_mode=3d needs q³ ranks (8, 27, 64, …)")
        return (("tp_j", q), ("tp_k", q), ("tp_i", q))
    require(tp % depth == 0, f"strategy.tp={tp} is not divisible by strategy.tp_depth={depth}")
    q = _root(tp // depth, 2)
    if mode == "2d":
        require(q is not None, f"strategy.tp={tp} is not a square; tp_mode=2d needs q² ranks (4, 9, 16, …)")
        return (("tp_row", q), ("tp_col", q))
    require(
        q is not None,
        f"strategy.tp={tp} is not tp_depth × a square = {depth} × q²; tp_mode=2.5d needs d·q² ranks (8 = 2 × 2², …)",
    )
    return (("tp_depth", depth), ("tp_row", q), ("tp_col", q))


def grid(mode: str, p: int, depth: int = 1) -> tuple[int, int]:
    """(q, d): the side of the grid and its depth (tp_grid's); 1-D and p = 1 are (1, 1)."""
    dims = dict(tp_grid(mode, p, depth)) if p > 1 else {}
    return dims.get("tp_col", dims.get("tp_k", 1)), dims.get("tp_depth", 1)


def weight_split(mode: str, p: int, depth: int = 1) -> tuple[int, int]:
    """Into how many blocks tensor parallelism splits (every matrix, every norm's gain): 1-D splits the
    matrices over p and copies the gains; 2-D and 2.5-D split matrices over the q×q grid (2.5-D copying it
    over depth) and gains over q; 3-D matrices over q³ and gains over q."""
    if p == 1 or mode == "1d":
        return p, 1
    q, _ = grid(mode, p, depth)
    return (q**3 if mode == "3d" else q * q), q


def fields(cfg: TrainConfig, sizes: dict[str, int]) -> dict[str, Any]:
    s = cfg.strategy
    tp_grid(s.tp_mode, s.tp, s.tp_depth)
    return {"tp_mode": s.tp_mode, "tp_depth": s.tp_depth}


def validate(cfg: TrainConfig) -> None:
    m, s, t = cfg.model, cfg.strategy, cfg.trainer
    if s.tp == 1:
        return
    if s.tp_mode != "1d":
        _validate_grid(cfg)
        return
    sizes = {"n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads or m.n_heads, "ffn_dim": m.ffn_dim}
    sizes["vocab_size"] = m.vocab_size
    if m.moe.num_experts and m.moe.shared_experts:  # split as a dense MLP; the routed experts stay whole
        sizes["moe.shared_experts × expert_dim"] = m.moe.shared_experts * (m.moe.expert_dim or m.ffn_dim)
    for key, v in sizes.items():
        require(v % s.tp == 0, f"strategy.tp={s.tp} does not divide model.{key}={v}; choose a tp that divides it")
    require(
        t.seq_len % s.tp == 0,
        f"strategy.tp={s.tp} does not divide trainer.seq_len={t.seq_len} (sequence parallelism shards it); "
        f"change one of them",
    )


def _validate_grid(cfg: TrainConfig) -> None:
    """2-D, 2.5-D and 3-D: the grid must divide every split dimension (distrain/parallel/tpnd/grid.py)."""
    m, s, t = cfg.model, cfg.strategy, cfg.trainer
    q, _ = grid(s.tp_mode, s.tp, s.tp_depth)
    mode = f"strategy.tp_mode={s.tp_mode} (tp={s.tp}"
    mode += f", tp_depth={s.tp_depth})" if s.tp_mode == "2.5d" else ")"
    require(
        s.zero == 0,
        f"{mode} does not combine with strategy.zero={s.zero} (FSDP2 takes at most two tensor-parallel "
        f"placements); use data parallelism (strategy.dp_replicate) beside it, or strategy.tp_mode=1d",
    )
    require(
        s.pp == 1 or not SCHEDULES[s.schedule].split_backward,
        f"{mode} does not combine with strategy.schedule={s.schedule} (its backward is computed whole); "
        f"choose another schedule",
    )
    require(s.offload == "none", f"{mode} does not support strategy.offload={s.offload}; set it to none")
    require(not s.compile, f"{mode} does not support strategy.compile=true; set it to false")
    head_dim, kv = m.head_width(), m.n_kv_heads or m.n_heads
    split = q * q if s.tp_mode == "3d" else q  # 3-D splits a weight's output features over two axes
    features = {"dim": m.dim, "ffn_dim": m.ffn_dim, "vocab_size": m.vocab_size}
    features |= {"n_heads × head_dim": m.n_heads * head_dim, "n_kv_heads × head_dim": kv * head_dim}
    for key, value in features.items():
        require(value % split == 0, f"{mode} splits model.{key}={value} {split} ways; choose sizes it divides")
    for key, value in (("n_heads", m.n_heads), ("n_kv_heads", kv)):
        require(value % q == 0, f"{mode} splits the heads {q} ways, but model.{key}={value}; choose sizes it divides")
    rows = q * q if s.tp_mode == "3d" else q * s.tp_depth  # the grid splits each micro-batch's sequences
    require(
        t.micro_batch_size % rows == 0,
        f"{mode} splits each micro-batch {rows} ways, but trainer.micro_batch_size={t.micro_batch_size}; "
        f"use a multiple of {rows}",
    )


def tp_coordinate(layout: Layout, rank: int) -> dict[str, int]:
    """Rank → its position on the tensor-parallel grid's dims (the tp coordinate, reshaped)."""
    c = layout.mesh_coordinate(rank)
    return {name: c[name] for name, _ in tp_grid(layout.tp_mode, layout.tp, layout.tp_depth)}


def _chunk(index: int, chunks: int, n: int) -> str:
    return f"{index * n // chunks}-{(index + 1) * n // chunks - 1}"


def plan_lines(cfg: TrainConfig, layout: Layout) -> list[str]:
    """Which block of the activations and weights each rank of one tensor-parallel group holds (every
    group holds the same blocks): the residual stream's sequences of a micro-batch and hidden features,
    and a dim×dim projection's block (distrain/parallel/tpnd/grid.py). 1-D: nothing beyond the mesh."""
    if layout.tp == 1 or layout.tp_mode == "1d":
        return []
    b, h = cfg.trainer.micro_batch_size, cfg.model.dim
    grid = dict(tp_grid(layout.tp_mode, layout.tp, layout.tp_depth))
    how = {"2d": "SUMMA", "2.5d": "SUMMA on each depth's grid", "3d": "3-D matmul"}[layout.tp_mode]
    lines = [f"tensor-parallel grid ({layout.tp_mode}: {' × '.join(f'{d}={n}' for d, n in grid.items())}, {how}); "
             f"a micro-batch of {b} sequences, hidden {h}; projection W[out, in] as nn.Linear holds it:"]  # fmt: skip
    for rank in range(layout.tp):
        c = tp_coordinate(layout, rank)
        where = ", ".join(f"{d} {v}" for d, v in c.items())
        if layout.tp_mode == "3d":
            q = grid["tp_k"]
            rows, hidden = _chunk(c["tp_i"] * q + c["tp_j"], q * q, b), _chunk(c["tp_k"], q, h)
            reading = f"W[out {_chunk(c['tp_j'] * q + c['tp_i'], q * q, h)}, in {hidden}]"
            writing = f"W[out {_chunk(c['tp_k'] * q + c['tp_i'], q * q, h)}, in {_chunk(c['tp_j'], q, h)}]"
            block = f"projections reading the stream {reading}, writing to it {writing}"
        else:
            q, depth = grid["tp_col"], grid.get("tp_depth", 1)
            rows, hidden = _chunk(c.get("tp_depth", 0) * q + c["tp_row"], depth * q, b), _chunk(c["tp_col"], q, h)
            block = f"W[out {hidden}, in {_chunk(c['tp_row'], q, h)}]" + (" (copied over depth)" if depth > 1 else "")
        lines.append(f"  rank {rank} ({where}): sequences {rows}, hidden {hidden}; {block}")
    return lines


TENSOR_PARALLEL = Parallelism(
    name="tp",
    dims=("tp",),
    defaults={"tp_mode": "1d", "tp_depth": 1},
    fields=fields,
    mesh=lambda values: dict(tp_grid(values["tp_mode"], values["tp"], values["tp_depth"])),
    validate=validate,
    plan_lines=plan_lines,
    # sequence parallelism splits every activation a block keeps with the rest
    activation_split=lambda layout: layout.tp,
    weight_split=lambda layout: weight_split(layout.tp_mode, layout.tp, layout.tp_depth),
)
