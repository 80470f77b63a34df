"""SUMMA (van de Geijn & Watts), the matrix product of 2-D (Optimus) and 2.5-D (Tesseract) tensor
parallelism, on one q×q grid: Y = X·Wᵀ with X [n, in] and the weight W [out, in] in nn.Linear's layout.

Rank (r, c) holds X(r, c) (rows chunk r, input-feature chunk c) and W's block (out chunk c, in chunk r),
and computes Y(r, c). The "row group" is the ranks sharing r, the "column group" those sharing c.

    forward, for l in 0..q-1:  X(r, l) broadcast along the row, W(c, l) along the column; Y += X(r,l)·W(c,l)ᵀ
    backward, for l:           W(c, l) broadcast along the column; dY·W(c, l) reduced along the row to (r, l)
                               X(r, l) broadcast along the row;    dYᵀ·X(r, l) reduced along the column to (l, c)

Only the local blocks are kept for the backward, which broadcasts them again (as the paper does): the
activation memory stays 1/q² of the layer's, at the price of twice the broadcasts.
"""

from __future__ import annotations

import torch

from distrain.parallel.tpnd.comm import Group, broadcast, index, reduce, size


class Summa(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, row: Group, column: Group) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.row, ctx.column = row, column
        y = x.new_zeros((x.shape[0], w.shape[0]))
        for step in range(size(row)):
            y += broadcast(x, row, step) @ broadcast(w, column, step).T
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        x, w = ctx.saved_tensors
        row, column = ctx.row, ctx.column
        dy = dy.contiguous()
        dx = dw = None
        for step in range(size(row)):
            part = reduce(dy @ broadcast(w, column, step), row, step)
            if index(row) == step:
                dx = part
            part = reduce(dy.T @ broadcast(x, row, step), column, step)
            if index(column) == step:
                dw = part
        return dx, dw, None, None


def summa(x: torch.Tensor, w: torch.Tensor, row: Group, column: Group) -> torch.Tensor:
    """x [..., in/q] @ w [out/q, in/q]ᵀ → [..., out/q], the leading dims kept."""
    return Summa.apply(x.flatten(0, -2), w, row, column).unflatten(0, x.shape[:-1])
