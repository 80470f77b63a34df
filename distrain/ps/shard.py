"""How the model's parameters are cut into server shards, how a worker moves between them, and
how a server optimizes its shard.

The parameters, flattened in model order, form one long vector; server k owns the k-th of
`num_servers` equal ranges of it. So the shards are balanced to one element, small tensors stay
whole unless they straddle a boundary, and a large tensor is split across servers. The optimizers
(SGD, AdamW) act elementwise, so a split tensor trains exactly as a whole one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from distrain.config import OptimConfig
from distrain.train.optim import make_optimizer


@dataclass(frozen=True)
class Piece:
    """Elements [start, end) of one flattened parameter."""

    name: str
    start: int
    end: int
    decay: bool  # a matrix (weight decay applies) rather than a norm's gain

    @property
    def size(self) -> int:
        return self.end - self.start


def split_into_shards(params: list[tuple[str, torch.Tensor]], num_servers: int) -> list[list[Piece]]:
    """The pieces each server owns, in order; every element of every parameter exactly once."""
    total = sum(p.numel() for _, p in params)
    bounds = [total * k // num_servers for k in range(num_servers + 1)]
    shards: list[list[Piece]] = [[] for _ in range(num_servers)]
    offset = 0
    for name, p in params:
        n = p.numel()
        for k in range(num_servers):
            lo, hi = max(bounds[k], offset), min(bounds[k + 1], offset + n)
            if lo < hi:
                shards[k].append(Piece(name, lo - offset, hi - offset, p.ndim >= 2))
        offset += n
    return shards


def model_shards(model: nn.Module, num_servers: int) -> list[list[Piece]]:
    return split_into_shards([(n, p) for n, p in model.named_parameters() if p.requires_grad], num_servers)


def as_tensor(array: np.ndarray) -> torch.Tensor:
    """An array that came through Ray as a tensor of our own: Ray hands large arrays over read-only,
    straight from its object store."""
    return torch.from_numpy(np.array(array, dtype=np.float32))


class ShardView:
    """One worker's way into one shard: gather the shard's gradient or weights out of the model
    into one flat vector, and write a flat vector of weights back into the model."""

    def __init__(self, model: nn.Module, pieces: list[Piece]):
        params = dict(model.named_parameters())
        self.pieces = [(params[p.name], p.start, p.end) for p in pieces]
        self.numel = sum(p.size for p in pieces)

    def gather(self, grad: bool) -> torch.Tensor:
        parts = [(p.grad if grad else p.detach()).reshape(-1)[a:b] for p, a, b in self.pieces]
        return torch.cat(parts).cpu()

    @torch.no_grad()
    def scatter(self, flat: torch.Tensor) -> None:
        offset = 0
        for p, a, b in self.pieces:
            p.view(-1)[a:b].copy_(flat[offset : offset + b - a])
            offset += b - a


class Slot:
    """An optimizer over aliases of the shard's pieces. Hogwild gives each worker one, so that
    concurrent pushes never share `.grad`; all slots share the same weights and state tensors."""

    def __init__(self, flat: torch.Tensor, pieces: list[Piece], cfg: OptimConfig) -> None:
        self.params, offset = [], 0
        for p in pieces:
            self.params.append(nn.Parameter(flat[offset : offset + p.size]))  # a view: the same storage
            offset += p.size
        decayed = [q for q, p in zip(self.params, pieces, strict=True) if p.decay]
        undecayed = [q for q, p in zip(self.params, pieces, strict=True) if not p.decay]
        self.optimizer = make_optimizer(decayed, undecayed, cfg)

    def step(self, grad: torch.Tensor, lr: float, clip: tuple[float, torch.Tensor] | None = None) -> None:
        """Apply one flat gradient; `clip` = (max_norm, the whole gradient's norm) scales it first."""
        offset = 0
        for q in self.params:
            q.grad = grad[offset : offset + q.numel()]
            offset += q.numel()
        if clip is not None:
            torch.nn.utils.clip_grads_with_norm_(self.params, *clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        for q in self.params:
            q.grad = None

    def share_state_of(self, lead: Slot) -> None:
        for q, q0 in zip(self.params, lead.params, strict=True):
            self.optimizer.state[q] = lead.optimizer.state[q0]  # one dict: its tensors are shared
