"""A config's `Layout`, from the registered parallelisms alone (distrain/strategy/__init__.py): each
record's dims, their sizes, its settings and its rules. `resolve` fills what the strategy leaves open from
the worker count, without touching the config, and refuses a layout that cannot work with a one-line
ConfigError; `smaller` is what an elastic run may shrink to; `layout_of` and `single` make one by hand."""

from __future__ import annotations

from typing import Any

from distrain.config import ConfigError, TrainConfig
from distrain.strategy import MESH_DIMS, PARALLELISMS
from distrain.strategy.layout import Layout
from distrain.strategy.parallelism import require


def _layout(values: dict[str, Any]) -> Layout:
    """The layout of the dims' sizes and the settings in `values`, each dim in its place on the mesh."""
    return Layout(
        dims={d: values[d] for d in MESH_DIMS},
        settings={k: v for k, v in values.items() if k not in MESH_DIMS},
        mesh_dims={name: size for p in PARALLELISMS for name, size in p.mesh_sizes(values).items()},
    )


def resolve(cfg: TrainConfig, world_size: int | None = None) -> Layout:
    """The layout of `cfg` on `world_size` workers (default cluster.num_workers): the dims the strategy
    config sets as they are, a parallelism with a `sizes` hook (data parallelism's -1 dim) the workers they
    leave, and each parallelism's settings (the stages per rank: its schedule's default)."""
    n = cfg.cluster.num_workers if world_size is None else world_size
    require(n >= 1, f"cluster.num_workers={n}: need at least 1 worker")
    fixed = {d: getattr(cfg.strategy, d) for p in PARALLELISMS if p.sizes is None for d in p.dims}
    fixed = {d: fixed[d] for d in MESH_DIMS if d in fixed}
    for key, v in reversed(fixed.items()):
        require(v >= 1, f"strategy.{key}={v}: must be at least 1")
    sizes = dict(fixed)
    for p in PARALLELISMS:
        if p.sizes is not None:
            sizes |= p.sizes(cfg, n, fixed)
    fields: dict[str, Any] = {}
    for p in PARALLELISMS:
        fields |= p.fields(cfg, sizes)
    layout = _layout({**sizes, **fields})
    for p in reversed(PARALLELISMS):
        p.check(cfg, layout)
    return layout


def layout_of(**given: Any) -> Layout:
    """A layout given by hand (tests, benchmarks), unchecked: the dims and settings named, every other dim 1
    and every other setting its parallelism's default."""
    values: dict[str, Any] = {d: 1 for d in MESH_DIMS}
    for p in PARALLELISMS:
        values |= p.defaults
    return _layout(values | given)


def single(micro_batches: int = 1) -> Layout:
    """One process holding the whole model (a parameter-server worker, a reference run)."""
    return layout_of(micro_batches=micro_batches)


def smaller(layout: Layout, cfg: TrainConfig) -> dict[int, Layout]:
    """What a run may shrink to after losing nodes: for each worker count below `layout`'s, down to
    cluster.min_workers, the layout if the strategy allows it with the same global batch (fewer workers take
    more accumulation steps); largest first."""
    layouts = {}
    for n in range(layout.world_size - 1, (cfg.cluster.min_workers or layout.world_size) - 1, -1):
        try:
            layouts[n] = resolve(cfg, n)
        except ConfigError:
            continue
    return layouts
