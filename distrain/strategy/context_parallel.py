"""Context parallelism as the driver sees it: the `cp` dim, each of whose ranks holds 1/cp of every
sequence, split load-balanced for causal attention (rank r the chunks r and 2·cp−1−r of 2·cp), its modes,
its rules and its plan section. Applied by distrain/parallel/context_parallel.py."""

from __future__ import annotations

from typing import Any

from distrain.config import TrainConfig
from distrain.strategy.layout import Layout
from distrain.strategy.parallelism import Parallelism, require

CP_MODES = ("ring", "alltoall")
TILE = 128  # query rows the ring's math fallback scores at once: TILE × a block's keys per head, never the block's
TILE_TENSORS = 4  # tile-sized fp32 tensors live at once in the fallback's backward: scores, probabilities, dP, dS


def chunks(seq_len: int, cp: int, rank: int) -> tuple[range, range]:
    """The two token ranges cp rank `rank` holds of a sequence: chunk `rank` of 2·cp from the front and its
    mirror from the back, so that under a causal mask every rank has the same work."""
    c = seq_len // (2 * cp)
    return range(rank * c, (rank + 1) * c), range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)


def fields(cfg: TrainConfig, sizes: dict[str, int]) -> dict[str, Any]:
    mode = cfg.strategy.cp_mode
    require(mode in CP_MODES, f"strategy.cp_mode={mode!r} is not a context-parallel mode; choose ring or alltoall")
    return {"cp_mode": mode}


def validate(cfg: TrainConfig) -> None:
    m, s, t = cfg.model, cfg.strategy, cfg.trainer
    if s.cp == 1:
        require(
            s.cp_mode == "ring",
            f"strategy.cp_mode={s.cp_mode} chooses how context parallelism exchanges the sequence, but strategy.cp=1: "
            f"set strategy.cp (2 or more; strategy=cp_alltoall is cp 2), or leave strategy.cp_mode out",
        )
        return
    cp = f"strategy.cp={s.cp}"
    require(
        t.seq_len % (2 * s.cp) == 0,
        f"{cp} splits each sequence into 2·cp = {2 * s.cp} chunks (load-balanced for the causal mask), but "
        f"trainer.seq_len={t.seq_len}; use a multiple of {2 * s.cp}",
    )
    require(
        (t.seq_len // s.cp) % s.tp == 0,
        f"{cp} leaves trainer.seq_len / cp = {t.seq_len // s.cp} tokens per rank, which strategy.tp={s.tp} does "
        f"not divide (sequence parallelism shards them); change one of them",
    )
    require(
        s.tp_mode == "1d",
        f"{cp} does not combine with strategy.tp_mode={s.tp_mode} (the grid layers' attention is not split over "
        f"the sequence); use strategy.tp_mode=1d",
    )
    require(
        cfg.ps.mode is None,
        f"{cp} does not combine with ps.mode={cfg.ps.mode} (a parameter-server worker holds whole sequences); "
        f"use an all-reduce strategy",
    )
    require(
        not s.compile,
        f"{cp} does not support strategy.compile=true (its attention's point-to-point exchanges break the "
        f"block's graph); set strategy.compile=false",
    )
    if s.cp_mode == "alltoall":
        kv = m.n_kv_heads or m.n_heads
        for key, heads in (("n_heads", m.n_heads), ("n_kv_heads", kv)):
            require(
                heads % (s.cp * s.tp) == 0,
                f"{cp} strategy.cp_mode=alltoall gives each rank heads / (cp × tp) = {heads} / {s.cp * s.tp} of "
                f"model.{key}={heads}; choose a cp × tp that divides it, or strategy.cp_mode=ring",
            )


def attention_traffic(mode: str, cp: int, tokens: int, heads: int, kv_heads: int, head_dim: int, element: int) -> float:
    """Bytes one rank sends for one layer's attention, forward and backward, holding `tokens` tokens (its
    share of a micro-batch's sequences) and `heads` / `kv_heads` heads of `element` bytes a value (those it
    holds under tensor parallelism), counted as distrain/parallel/traffic.py counts. ring: K and V go cp − 1
    hops in the forward and again in the backward, and their fp32 gradients cp hops (the last one home);
    alltoall: Q, K, V and the output each cross one all-to-all in the forward, their gradients one in the
    backward, of which a rank sends the (cp − 1)/cp it does not keep."""
    q, kv = tokens * heads * head_dim, tokens * kv_heads * head_dim
    if mode == "ring":
        return 2 * kv * (2 * (cp - 1) * element + cp * 4)
    return 2 * (cp - 1) / cp * (2 * q + 2 * kv) * element


def ring_scores(cfg: TrainConfig, layout: Layout) -> int | None:
    """Bytes of the scores ring attention holds at once on a rank, at most: its math fallback's, in its backward
    (fp32: TILE_TENSORS tiles of TILE query rows against a block's keys, the rank's two chunks at most, for each
    of the rank's heads and sequences); a fused kernel holds only its own small tiles. None without ring cp,
    whose attention (the fused kernel's, or all-to-all's) the plan counts as Korthikanti does."""
    if layout.cp == 1 or layout.cp_mode != "ring":
        return None
    keys = cfg.trainer.seq_len // layout.cp
    heads = cfg.model.n_heads // layout.tp
    return TILE_TENSORS * cfg.trainer.micro_batch_size * heads * min(TILE, keys) * keys * 4


def _tokens(r: range) -> str:
    return f"{r.start}-{r.stop - 1}"


def plan_lines(cfg: TrainConfig, layout: Layout) -> list[str]:
    """Which tokens of every sequence each cp rank holds (every cp group holds the same)."""
    if layout.cp == 1:
        return []
    seq = cfg.trainer.seq_len
    how = "K/V passed round the ring" if layout.cp_mode == "ring" else "heads <-> sequence all-to-all"
    lines = [f"context parallel ({layout.cp_mode}: {how}); each rank holds {seq // layout.cp} of {seq} tokens:"]
    for rank in range(layout.cp):
        front, back = chunks(seq, layout.cp, rank)
        lines.append(f"  cp rank {rank}: tokens {_tokens(front)}, {_tokens(back)}")
    m, tp = cfg.model, layout.tp
    tokens = cfg.trainer.micro_batch_size * seq // layout.cp
    element = 2 if cfg.trainer.precision == "bf16" else 4  # auto: as on a CPU (fp32) unless told
    sent = attention_traffic(
        layout.cp_mode,
        layout.cp,
        tokens,
        m.n_heads // tp,
        (m.n_kv_heads or m.n_heads) // tp,
        m.head_width(),
        element,
    )
    lines.append(f"  each rank sends {sent / 2**20:.2f} MiB per layer and micro-batch (forward and backward)")
    return lines


CONTEXT_PARALLEL = Parallelism(
    name="cp",
    dims=("cp",),
    defaults={"cp_mode": "ring"},
    fields=fields,
    validate=validate,
    plan_lines=plan_lines,
    # every activation of a block is its tokens' (all-to-all's attention scores too: heads/cp of them; the ring
    # holds none, ring_scores)
    activation_split=lambda layout: layout.cp,
)
