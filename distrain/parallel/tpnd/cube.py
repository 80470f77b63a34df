"""The 3-D matrix product (Bian et al. 2021, after Agarwal et al.'s 3-D algorithm) on a q×q×q cube
with coordinates (j, k, i): Y_ij = Σ_k X_ik W_kj, X's rows over i, the reduction over k, the output
features over j. Every operand is split over all three axes, so each rank holds 1/q³ of each:

    X_ik = all-gather of X over j       (rank (j,k,i) holds rows piece j of X_ik)
    W_kj = all-gather of W over i       (and W's rows piece i of W_kj)
    Y_ij = reduce-scatter of X_ik·W_kjᵀ over k, by rows: rank (j,k,i) keeps rows piece k of Y_ij

The output's rows are split over k and its features over j, the input's the other way round, so the
next product swaps the roles of j and k (`transposed`): a block's "in" projections (reading the
residual stream) go one way and its "out" projections (writing to it) the other, and the stream
always has its rows over (i, j) and its features over k. The backward is autograd's: each
all-gather's is a reduce-scatter and the other way round; the gathered X and W are kept for it.
"""

from __future__ import annotations

import torch

from distrain.parallel.tpnd.comm import Group, gather_rows, scatter_rows


def cube_matmul(x: torch.Tensor, w: torch.Tensor, gather: Group, weights: Group, reduce: Group) -> torch.Tensor:
    """x [rows, ..., in/q] · w [out/q² rows of out/q, in/q]ᵀ: gather x's rows over `gather`, w's over
    `weights`, reduce-scatter the product's rows over `reduce`."""
    x = gather_rows(x, gather)
    w = gather_rows(w, weights)
    return scatter_rows(x @ w.T, reduce)
