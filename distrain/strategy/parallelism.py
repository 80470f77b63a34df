"""The record a parallelism registers (distrain/strategy/__init__.py): everything the driver knows of
it, in plain Python, and the one source of its part of the `Layout` (its dims, their sizes, its settings).
How it is applied to the model is its pass in distrain/parallel/parallelize.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from distrain.config import ConfigError, TrainConfig
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
    what its parallelism changes. `dims` are the Layout's dims (their sizes) and the mesh's, outermost
    first; the registry's order places them on the mesh."""

    name: str  # the key of its pass in distrain/parallel/parallelize.py
    dims: tuple[str, ...]
    # Its dims' sizes on n workers, given the sizes of the dims read as they are from the strategy config (those
    # of the records without this hook, mesh order): a parallelism that takes the workers the others leave.
    sizes: Callable[[TrainConfig, int, dict[str, int]], dict[str, int]] | None = None
    # Its other Layout fields (settings) and their values in a layout made by hand (distrain.strategy.resolve).
    defaults: dict[str, Any] = field(default_factory=dict)
    # Those fields, from the config and the resolved sizes (the pipeline's schedule, ...).
    fields: Callable[[TrainConfig, dict[str, int]], dict[str, Any]] = _no_fields
    # Its dims as the device mesh lays them out, when not as they are (tensor parallelism's grid).
    mesh: Callable[[dict[str, Any]], dict[str, int]] | None = None
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

    def mesh_sizes(self, values: dict[str, Any]) -> dict[str, int]:
        """Its device-mesh dims, from a layout's dims and settings by name."""
        return self.mesh(values) if self.mesh else {d: values[d] for d in self.dims}
