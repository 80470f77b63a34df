"""Every parallelism distrain composes, registered here, in mesh order (outermost first): what the driver
knows of each (its mesh dims, its part of the layout, its rules, its section of `--plan`, how it splits
memory), torch-free; how each is applied to the model is its pass in distrain/parallel/, under the same
name. distrain/strategy/resolve.py resolves each one's dims and settings in this order; rules are checked,
and plan sections printed, innermost first. A new parallelism (or a new dim) is a module here with its
record, added to this tuple (docs/extending.md).
Context parallelism sits between data and tensor parallelism, as in torchtitan and Megatron: next to dp_shard,
so that the two fold into one gradient group (both hold different tokens of the same weights), and outside tp,
which needs the fastest links (docs/context-parallel.md). Expert parallelism has no dim: it borrows ranks of
the gradient group (distrain/strategy/expert_parallel.py)."""

from __future__ import annotations

from distrain.strategy.context_parallel import CONTEXT_PARALLEL
from distrain.strategy.data_parallel import DATA_PARALLEL
from distrain.strategy.expert_parallel import EXPERT_PARALLEL
from distrain.strategy.parallelism import Parallelism
from distrain.strategy.pipeline import PIPELINE
from distrain.strategy.tensor_parallel import TENSOR_PARALLEL

PARALLELISMS: tuple[Parallelism, ...] = (
    PIPELINE,
    DATA_PARALLEL,
    CONTEXT_PARALLEL,
    EXPERT_PARALLEL,
    TENSOR_PARALLEL,
)
MESH_DIMS = tuple(d for p in PARALLELISMS for d in p.dims)  # outermost to innermost: pp, dp_replicate, dp_shard, cp, tp
