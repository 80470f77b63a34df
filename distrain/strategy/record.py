"""The record a parallelism registers (distrain/strategy/__init__.py): everything the driver knows of
it, in plain Python. How it is applied to the model is its step in distrain/parallel/parallelize.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distrain.config import ConfigError, TrainConfig

if TYPE_CHECKING:
    from distrain.strategy.layout import Layout


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _no_fields(cfg: TrainConfig, sizes: dict[str, int]) -> dict[str, Any]:
    return {}


def _no_rules(*_: object) -> None:
    return None


def _no_lines(cfg: TrainConfig, layout: Layout) -> list[str]:
    return []


def _whole(layout: Layout) -> int:
    return 1


def _unsplit(layout: Layout) -> tuple[int, int]:
    return 1, 1


@dataclass(frozen=True)
class Parallelism:
    """One parallelism as the driver sees it. Every hook has a do-nothing default: a record names only
    what its parallelism changes. `dims` are Layout fields (their sizes) and the mesh's dims, outermost
    first; the registry's order places them on the mesh."""

    name: str  # the key of its step in distrain/parallel/parallelize.py
    dims: tuple[str, ...]
    # Its other Layout fields, from the config and the resolved sizes (the pipeline's schedule, ...).
    fields: Callable[[TrainConfig, dict[str, int]], dict[str, Any]] = _no_fields
    # Its dims as the device mesh lays them out, when not as they are (tensor parallelism's grid).
    mesh: Callable[[Layout], dict[str, int]] | None = None
    # Rules on a resolved layout: run for the run's layout and every one an elastic run may shrink to.
    check: Callable[[TrainConfig, Layout], None] = _no_rules
    # Rules on the rest of the config (the model's shape, ...), run once the model is checked.
    validate: Callable[[TrainConfig], None] = _no_rules
    # Its section of `--plan`.
    plan: Callable[[TrainConfig, Layout], list[str]] = _no_lines
    # Into how many pieces it splits a block's activations, and a weight matrix and a vector (norm gains,
    # biases), on each rank: the memory estimate (distrain/driver/plan.py) divides by them.
    activation_split: Callable[[Layout], int] = _whole
    weight_split: Callable[[Layout], tuple[int, int]] = _unsplit

    def mesh_sizes(self, layout: Layout) -> dict[str, int]:
        return self.mesh(layout) if self.mesh else {d: getattr(layout, d) for d in self.dims}
