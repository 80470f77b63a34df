"""The bytes of tensor parallelism in theory, per rank: what 1-D (Megatron with sequence parallelism),
2-D (SUMMA), 2.5-D (Tesseract) and 3-D send and receive in one forward and backward pass of one
micro-batch, and the weights and saved activations each rank holds. Derived from the algorithms as
distrain runs them (distrain/parallel/tpnd/, and DTensor's plan for 1-D), op by op, so that
jobs/bench/bench_tp.py can set them beside the bytes it counts; `tp_memory` is also the plan's estimate.
Plain Python: it imports neither torch nor Ray.

Traffic follows docs/collectives.md's convention: a rank of a group of g sends (and receives)
2(g−1)/g·n for an all-reduce of n bytes and (g−1)/g·n for an all-gather (n: its output), a
reduce-scatter (n: its input), a broadcast or a reduce.
"""

from __future__ import annotations

from typing import Any

from distrain.strategy.tensor_parallel import grid, weight_split


def _get(model: Any, key: str) -> Any:
    return model[key] if isinstance(model, dict) else getattr(model, key)


def shape(model: Any) -> dict[str, int]:
    """The sizes the formulas use: h (dim), k (K and V's width), f (ffn), H (heads), V (vocab), L (layers)."""
    h, heads = _get(model, "dim"), _get(model, "n_heads")
    kv = _get(model, "n_kv_heads") or heads
    return {"h": h, "k": kv * h // heads, "f": _get(model, "ffn_dim"), "H": heads, "V": _get(model, "vocab_size"),
            "L": _get(model, "n_layers")}  # fmt: skip


def linears(s: dict[str, int]) -> list[tuple[int, int]]:
    """(in, out) of every linear layer, the LM head last."""
    h, k, f = s["h"], s["k"], s["f"]
    return [(h, h), (h, k), (h, k), (h, h), (h, f), (h, f), (f, h)] * s["L"] + [(h, s["V"])]


def linear_traffic(mode: str, q: int, d: int, n: int, i: int, o: int) -> float:
    """Elements one rank sends in one linear's forward and backward, X [n, i] · W [i, o] (the papers'
    per-linear costs): SUMMA broadcasts X and W in the forward, W and X again and reduces dX and dW in the
    backward, each q times in a group of q; 3-D all-gathers X and W and reduce-scatters Y, and the mirror."""
    if mode in ("2d", "2.5d"):
        return 3 * (q - 1) * (n * i / d + i * o) / q**2
    if mode == "3d":
        return 2 * (q - 1) * (n * i + n * o + i * o) / q**3
    raise ValueError(mode)


def tp_traffic(model: Any, mode: str, p: int, depth: int, micro_batch: int, seq_len: int,
               bytes_per_elem: int = 4) -> dict[str, float]:  # fmt: skip
    """Bytes one rank sends (= receives) in one forward and backward pass of one micro-batch, by part:
    "linears" (the LM head included), "embedding", "norms", "loss", "grad_sync" (the gradients of weights
    copied over grid dims: 2.5-D's depth, the norms' gains) and "total". Every rank's is the same."""
    s, n = shape(model), micro_batch * seq_len
    h, V, L = s["h"], s["V"], s["L"]
    norms = 2 * L + 1
    out = dict.fromkeys(("linears", "embedding", "norms", "loss", "grad_sync"), 0.0)
    if p > 1 and mode == "1d":
        share = (p - 1) / p
        # An all-gather in and a reduce-scatter out per sublayer, the embedding's reduce-scatter, the head's
        # all-gather; each mirrored in the backward. The loss: max, sum of exponentials and the target's
        # logit all-reduced over the vocabulary shards; the norms' gains' gradients all-reduced.
        out["linears"] = 2 * share * n * h * (4 * L + 1)
        out["embedding"] = 2 * share * n * h
        out["loss"] = 3 * 2 * share * n
        out["grad_sync"] = 2 * share * norms * h
    elif p > 1:
        q, d = grid(mode, p, depth)
        ar = 2 * (q - 1) / q  # all-reduce over a group of q, per element
        out["linears"] = sum(linear_traffic(mode, q, d, n, i, o) for i, o in linears(s))
        if mode == "3d":
            rows = n / q**2  # the residual stream's rows on a rank
            out["embedding"] = 2 * (q - 1) / q * (n * h / q + n * h / q**2)  # reduce-scatter over i, then j
            out["loss"] = 3 * ar * rows + 2 * ar  # 3 row vectors over the vocabulary; the sum over k and i
            out["grad_sync"] = norms * h / q * 2 * ar  # gains copied over j and i
        else:
            rows = n / (d * q)
            out["embedding"] = 2 * (q - 1) / q * (n / d) * h / q  # reduce-scatter over the column
            out["loss"] = 3 * ar * rows + ar + 2 * (d - 1) / d
            depth_ar = 2 * (d - 1) / d
            weights = sum(i * o for i, o in linears(s)) + V * h
            out["grad_sync"] = depth_ar * weights / q**2 + norms * h / q * (ar + depth_ar)
        out["norms"] = norms * 2 * ar * rows  # each row's sum of squares, forward and backward
    out = {k: v * bytes_per_elem for k, v in out.items()}
    out["total"] = sum(out.values())
    return out


def block_activations(s: dict[str, int], mode: str, p: int, depth: int, n: int) -> float:
    """Elements autograd saves in one block on one rank. One process saves, per token: 3h + 1 per norm
    (input, 1/rms, input/rms, output), Q and K rotated and V (h + 2k), attention's output and log-sum-exp
    (h + H), and SwiGLU's four (4f). 1-D keeps 1/p of those but each sublayer's all-gathered input whole
    (and not the sharded norm output); 2-D and 2.5-D 1/p of all, their 1/rms over the features' q ranks;
    3-D 1/p as well, plus the gathered X (n/q rows) and W (1/q²) each 3-D linear keeps for its backward, in
    place of the local norm outputs and SwiGLU product."""
    h, k, f, H = s["h"], s["k"], s["f"], s["H"]
    per_token = 8 * h + 2 * k + 4 * f + H + 2
    if p == 1:
        return n * per_token
    if mode == "1d":
        return n * (per_token - 2 * h) / p + 2 * n * h
    q, d = grid(mode, p, depth)
    if mode == "3d":
        gathered_x = n * (6 * h + f) / q**2
        gathered_w = (2 * h * h + 2 * h * k + 3 * h * f) / q**2
        # the norms' outputs and SwiGLU's product are kept only gathered (in gathered_x)
        return n * (per_token - 2 - 2 * h - f) / p + 2 * n / q**2 + gathered_x + gathered_w
    return n * (per_token - 2) / p + 2 * n / (d * q)


def tp_memory(model: Any, mode: str, p: int, depth: int, micro_batch: int, seq_len: int,
              bytes_per_elem: int = 4) -> dict[str, float]:  # fmt: skip
    """Bytes one rank holds: "weights" (exact from the placements: 1-D splits every matrix p ways and copies
    the norms' gains; 2-D and 2.5-D split matrices over the q×q grid and gains over q; 3-D matrices over q³,
    gains over q) and "activations" (what autograd saves in the blocks for one micro-batch)."""
    s, n = shape(model), micro_batch * seq_len
    matrices = sum(i * o for i, o in linears(s)) + s["V"] * s["h"]
    gains = (2 * s["L"] + 1) * s["h"]
    matrix_blocks, gain_blocks = weight_split(mode, p, depth)
    weights = matrices / matrix_blocks + gains / gain_blocks
    activations = s["L"] * block_activations(s, mode, p, depth, n)
    return {"weights": weights * bytes_per_elem, "activations": activations * bytes_per_elem}
