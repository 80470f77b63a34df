"""A rank's place on the tensor-parallel grid: which block of every weight and activation it holds,
and how each kind of layer computes and communicates there. One class per scheme; the layers
(layers.py) ask their grid and know nothing of the scheme.

Roles of the weights, from the model's plan: "in" projections read the residual stream (Q, K, V, the
MLP's first two, the LM head), "out" projections write to it (attention's output, the MLP's last),
"embedding", "norm" (a gain over the hidden features).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from distrain.parallel.tpnd.comm import Group, all_reduce, index, scatter_rows, size
from distrain.parallel.tpnd.cube import cube_matmul
from distrain.parallel.tpnd.summa import summa


class Grid:
    """What every scheme shares; a subclass names its dims (outermost first) and says, per role, the
    weight's placements (`weight_layout`) and how the linear, the embedding and the loss's rows go."""

    dims: tuple[str, ...]

    def __init__(self, mesh: DeviceMesh):
        """`mesh`: the run's device mesh; dims of size 1 are absent from it and count as size 1 here."""
        present = tuple(d for d in self.dims if d in (mesh.mesh_dim_names or ()))
        self.placed_dims = present
        self.mesh = mesh[present] if len(present) > 1 else mesh[present[0]]
        self.along: dict[str, Group] = {d: (mesh.get_group(d) if d in present else None) for d in self.dims}
        self.at = {d: index(g) for d, g in self.along.items()}
        self.size = {d: size(g) for d, g in self.along.items()}

    def placements(self, role: str) -> tuple[Placement, ...]:
        """The weight's DTensor placements on `self.mesh`, one per present dim."""
        by_dim = self.weight_layout(role)
        return tuple(by_dim[d] for d in self.placed_dims)

    def copied_dims(self, t: torch.Tensor) -> tuple[str, ...]:
        """The grid dims a weight (or its gradient) is copied on, not split over; none for a plain tensor."""
        placements = t.placements if isinstance(t, DTensor) else ()
        return tuple(d for d, p in zip(self.placed_dims, placements, strict=True) if isinstance(p, Replicate))

    def total_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The 2-norm of the whole gradient: each rank's squares (a block copied over grid dims counted
        once over its copies), summed over the grid, one scalar all-reduce per grid dim."""
        squares = torch.zeros((), device=grads[0].device)
        for g in grads:
            squares += g.to_local().float().pow(2).sum() / math.prod(self.size[d] for d in self.copied_dims(g))
        for d in self.dims:
            squares = all_reduce(squares, self.along[d])
        return squares.sqrt()

    def embed(self, tokens: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: each rank looks its vocabulary chunk up for the rows its plane
        covers (zeros for tokens outside it), then the plane sums and splits the rows."""
        rows = self.embedding_rows(tokens.shape[0])
        start = self.embedding_vocab_chunk() * weight.shape[0]
        local = tokens[rows] - start
        inside = (local >= 0) & (local < weight.shape[0])
        h = torch.nn.functional.embedding(local.clamp(0, weight.shape[0] - 1), weight) * inside.unsqueeze(-1)
        for group in self.embedding_reduce():
            h = scatter_rows(h, group)
        return h

    def logit_rows(self, n: int) -> slice:
        """The rows of the micro-batch whose logits this rank holds."""
        chunk, chunks = self.logit_chunk()
        return slice(chunk * n // chunks, (chunk + 1) * n // chunks)


class Grid2D(Grid):
    """2-D (Optimus; tp_depth absent or 1) and 2.5-D (Tesseract: tp_depth grids of q×q). Rank
    (depth, r, c) holds rows chunk depth·q + r and feature chunk c of every activation; weights are
    split over (r, c) as SUMMA wants them and copied over depth, whose gradients are summed there."""

    dims = ("tp_depth", "tp_row", "tp_col")

    def weight_layout(self, role: str) -> dict[str, Placement]:
        if role == "norm":
            return {"tp_depth": Replicate(), "tp_row": Replicate(), "tp_col": Shard(0)}
        if role == "embedding":  # [vocab, hidden]: vocabulary chunk r, hidden chunk c
            return {"tp_depth": Replicate(), "tp_row": Shard(0), "tp_col": Shard(1)}
        return {"tp_depth": Replicate(), "tp_row": Shard(1), "tp_col": Shard(0)}  # [out chunk c, in chunk r]

    def linear(self, x: torch.Tensor, w: torch.Tensor, role: str) -> torch.Tensor:
        return summa(x, w, row=self.along["tp_col"], column=self.along["tp_row"])

    def embedding_rows(self, n: int) -> slice:
        d = self.size["tp_depth"]
        return slice(self.at["tp_depth"] * n // d, (self.at["tp_depth"] + 1) * n // d)

    def embedding_vocab_chunk(self) -> int:
        return self.at["tp_row"]

    def embedding_reduce(self) -> list[Group]:
        return [self.along["tp_row"]]

    @property
    def feature_group(self) -> Group:
        """The ranks holding the other hidden chunks of this rank's rows (the norms sum over them)."""
        return self.along["tp_col"]

    @property
    def vocab_group(self) -> Group:
        """The ranks holding the other vocabulary chunks of this rank's logits."""
        return self.along["tp_col"]

    def head_vocab_chunk(self) -> int:
        return self.at["tp_col"]

    def logit_chunk(self) -> tuple[int, int]:
        q = self.size["tp_row"]
        return self.at["tp_depth"] * q + self.at["tp_row"], self.size["tp_depth"] * q

    @property
    def row_groups(self) -> list[Group]:
        """The groups whose members hold different rows of the logits."""
        return [self.along["tp_row"], self.along["tp_depth"]]


class Grid3D(Grid):
    """3-D (cube.py): the residual stream's rows chunk i·q + j and hidden chunk k at rank (j, k, i)."""

    dims = ("tp_j", "tp_k", "tp_i")

    def weight_layout(self, role: str) -> dict[str, Placement]:
        if role == "norm":
            return {"tp_j": Replicate(), "tp_k": Shard(0), "tp_i": Replicate()}
        if role == "out":  # [out chunk k, sub-chunk i; in chunk j]
            return {"tp_j": Shard(1), "tp_k": Shard(0), "tp_i": Shard(0)}
        # "in" [out chunk j, sub-chunk i; in chunk k]; "embedding" [vocab chunk j·q + i, hidden chunk k]
        return {"tp_j": Shard(0), "tp_k": Shard(1), "tp_i": Shard(0)}

    def linear(self, x: torch.Tensor, w: torch.Tensor, role: str) -> torch.Tensor:
        j, k = self.along["tp_j"], self.along["tp_k"]
        gather, reduce = (k, j) if role == "out" else (j, k)
        return cube_matmul(x, w, gather, self.along["tp_i"], reduce)

    def embedding_rows(self, n: int) -> slice:
        return slice(0, n)

    def embedding_vocab_chunk(self) -> int:
        return self.at["tp_j"] * self.size["tp_i"] + self.at["tp_i"]

    def embedding_reduce(self) -> list[Group]:
        return [self.along["tp_i"], self.along["tp_j"]]  # rows chunk i, then its piece j

    @property
    def feature_group(self) -> Group:
        return self.along["tp_k"]

    @property
    def vocab_group(self) -> Group:
        return self.along["tp_j"]

    def head_vocab_chunk(self) -> int:
        return self.at["tp_j"]

    def logit_chunk(self) -> tuple[int, int]:
        q = self.size["tp_k"]
        return self.at["tp_i"] * q + self.at["tp_k"], self.size["tp_i"] * q

    @property
    def row_groups(self) -> list[Group]:
        return [self.along["tp_k"], self.along["tp_i"]]


GRIDS = {"2d": Grid2D, "2.5d": Grid2D, "3d": Grid3D}
