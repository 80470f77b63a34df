"""The differences between the torch releases distrain supports (torch >= 2.11), in one place.

Nothing else in distrain (or its jobs and tests) asks which torch it runs on. Each guard picks by what
the installed torch has, never by its version number, and tests/test_compat.py runs both branches of
every guard on CPU by presenting the older API.

| guard                      | torch 2.11                                   | torch 2.13                        |
| -------------------------- | -------------------------------------------- | --------------------------------- |
| `ddp_without_buffer_sync`  | `broadcast_buffers=False`                    | `forward_sync_buffers=False`      |
| `all_gather_single`,       | `all_gather_into_tensor`,                    | the `*_single` names              |
| `reduce_scatter_single`    | `reduce_scatter_tensor`                      |                                   |
| `checkpoint_stager`        | DefaultStager empties its StateDictStager    | keeps it: host copies reused      |
|                            | after every stage: a second stage raised     |                                   |
|                            | `KeyError: <class 'type'>`                   |                                   |
| `settle_gradients`         | a replicated parameter fed by sharded        | its gradient is reduced in the    |
|                            | activations (1-D TP's norms) keeps a Partial | backward, as its parameter's      |
|                            | gradient, which clipping left unscaled       | placement says                    |

Private torch names distrain relies on, the first place to look after a torch upgrade:

- `DefaultStager._state_dict_stager` and its `close` (checkpoint_stager, here);
- DCP's `.metadata` pickle: `metadata._MEM_FORMAT_ENCODING`, `filesystem._StorageInfo`,
  `serialization._get_layout` (safeload._metadata_globals), and `FileSystemReader._get_metadata_path`
  (safeload._guarded_reader);
- `distributed_c10d._abort_process_group`, `_set_pg_timeout` and `_world.pg_map`, and
  `torch.distributed.tensor.debug._clear_sharding_prop_cache` (parallel/process_group.py);
- `DistributedDataParallel._set_params_and_buffers_to_ignore_for_model` (parallel/data_parallel.py: expert
  parallelism's experts left out of DDP);
- `torch.distributed._composable.replicate_with_fsdp.replicate` (parallel/data_parallel.py) and
  `torch.distributed._composable.checkpoint` (parallel/parallelize.py);
- `torch.utils._python_dispatch`, `torch.ops._c10d_functional`, `torch._ops.OpOverload` (parallel/traffic.py);
- `torch._dynamo`, imported by a hot spare to warm up (train/rank.py).
- `torch.optim._muon._zeropower_via_newtonschulz` and its constants (train/muon.py: torch.optim.Muon's
  Newton–Schulz iteration, one matrix at a time).
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel


def ddp_without_buffer_sync(ddp_class: type = DistributedDataParallel) -> dict[str, bool]:
    """DDP's keyword that stops it broadcasting buffers before every forward (distrain's only buffers are
    constant rotary tables, computed alike on every rank). torch < 2.13 has no `forward_sync_buffers`;
    its `broadcast_buffers=False` also skips the broadcast when DDP wraps the model, which the same
    reason makes unneeded."""
    if "forward_sync_buffers" in inspect.signature(ddp_class.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def settle_gradients(params: list[nn.Parameter]) -> None:
    """Give every DTensor gradient its parameter's placements. torch 2.11 leaves the gradient of a
    replicated parameter computed from sequence-sharded activations (1-D tensor parallelism's norms)
    Partial, a sum still to be taken, and clipping's in-place scaling did not reach it (seen: with a
    gradient norm of 1.33 clipped to 1, the norms' gradients were 1.33× one process's)
    Newer torch reduces it in the backward, and nothing here moves."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
            p.grad = g.redistribute(p.device_mesh, p.placements)


def newer_or_older(module: ModuleType | Any, newer: str, older: str) -> Any:
    """`module.newer` where this torch has it, else `module.older` (the same function under its old name)."""
    found = getattr(module, newer, None)
    return found if found is not None else getattr(module, older)


all_gather_single = newer_or_older(dist, "all_gather_single", "all_gather_into_tensor")
reduce_scatter_single = newer_or_older(dist, "reduce_scatter_single", "reduce_scatter_tensor")


def checkpoint_stager(pin: bool, stager_class: type[DefaultStager] = DefaultStager) -> DefaultStager:
    """A DefaultStager for every save of a run, keeping its host copies (pinned on an accelerator) from
    one save to the next, so that only the first save allocates them.

    torch 2.11's DefaultStager closes its StateDictStager after each stage, to break a reference cycle
    between the stager and its deep-copy table; closing empties the table and the cache of copies, and
    the next stage fails. Here that close waits for the stager's own `close`, as in newer torch (where
    holding the cycle for the stager's life is what happens anyway). Without an accelerator nothing is
    pinned and the copies are plain, blocking ones."""
    accelerator = torch.accelerator.is_available()
    stager = stager_class(
        StagingOptions(
            use_pinned_memory=pin and accelerator,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=pin and accelerator,
        )
    )
    copies = stager._state_dict_stager
    close_copies = copies.close
    copies.close = lambda: None  # instance attribute: what torch 2.11 calls after each stage
    close_stager = stager.close

    def close() -> None:
        copies.close = close_copies
        close_stager()

    stager.close = close
    return stager
