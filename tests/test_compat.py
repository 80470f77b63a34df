"""distrain/compat.py: both branches of every guard, the older one by presenting the older torch's API
(the CI's torch is the newer one; a run of these tests on torch 2.11 takes the older branches for real)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.nn.parallel import DistributedDataParallel

from distrain import compat

pytestmark = [pytest.mark.usefixtures("process_group"), pytest.mark.timeout(60)]


class OlderDDP(DistributedDataParallel):
    """DDP as torch 2.11 declares it: no forward_sync_buffers."""

    def __init__(self, module: nn.Module, broadcast_buffers: bool = True, **kwargs: object):
        assert "forward_sync_buffers" not in kwargs
        super().__init__(module, broadcast_buffers=broadcast_buffers, **kwargs)


class OlderStager(DefaultStager):
    """DefaultStager as torch 2.11 behaves: it closes its StateDictStager after every stage."""

    def _stage(self, state_dict: dict, **kwargs: object) -> dict:
        staged = super()._stage(state_dict, **kwargs)
        self._state_dict_stager.close()
        return staged


@pytest.mark.parametrize("ddp_class", [DistributedDataParallel, OlderDDP], ids=["newer", "older"])
def test_ddp_is_built_without_a_buffer_broadcast_before_each_forward(ddp_class: type):
    kwargs = compat.ddp_without_buffer_sync(ddp_class)
    newer = "forward_sync_buffers" in inspect.signature(ddp_class.__init__).parameters
    assert kwargs == ({"forward_sync_buffers": False} if newer else {"broadcast_buffers": False})
    model = ddp_class(nn.Linear(4, 4), **kwargs)  # the class accepts what the guard chose
    model(torch.ones(2, 4)).sum().backward()
    assert model.module.weight.grad is not None


def test_a_renamed_collective_is_taken_under_the_name_this_torch_has():
    def newer() -> None: ...

    def older() -> None: ...

    assert compat.newer_or_older(SimpleNamespace(new=newer, old=older), "new", "old") is newer
    assert compat.newer_or_older(SimpleNamespace(old=older), "new", "old") is older
    want = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    assert compat.all_gather_single is getattr(dist, want)
    out, x = torch.zeros(3), torch.arange(3.0)  # one rank: the gather and the scatter are copies
    compat.all_gather_single(out, x)
    assert torch.equal(out, x)
    compat.reduce_scatter_single(out := torch.zeros(3), x)
    assert torch.equal(out, x)


@pytest.mark.parametrize("stager_class", [DefaultStager, OlderStager], ids=["newer", "older"])
def test_a_stager_stages_every_save_of_a_run_into_the_same_host_copies(stager_class: type):
    state = {"w": torch.ones(8), "optim": {"step": torch.tensor(1.0), "lr": 0.1, "betas": (0.9, 0.95)}}
    stager = compat.checkpoint_stager(pin=True, stager_class=stager_class)  # nothing to pin on a CPU
    first = stager.stage(state)
    state["w"].add_(1)
    second = stager.stage(state)  # torch 2.11's own stager: KeyError: <class 'type'>
    assert second["optim"] == {"step": torch.tensor(1.0), "lr": 0.1, "betas": (0.9, 0.95)}
    assert torch.equal(second["w"], torch.full((8,), 2.0))
    assert second["w"].data_ptr() == first["w"].data_ptr() != state["w"].data_ptr()  # copied, into the same copy
    stager.close()
    assert len(stager._state_dict_stager._cached_storage_mapping) == 0  # the copies are released at the end


def test_the_older_stager_presented_fails_as_torch_211_did():
    """The presentation above is faithful: the older stager, unguarded, fails at its second stage."""
    stager = OlderStager(StagingOptions(False, False, False, False))
    stager.stage({"w": torch.ones(2), "n": 1})
    with pytest.raises(KeyError):
        stager.stage({"w": torch.ones(2), "n": 1})
    stager.close()


def test_a_gradient_is_given_its_parameters_placement_before_clipping():
    """torch 2.11 left a replicated parameter's gradient Partial (1-D TP's norms) and clipping missed it;
    newer torch hands it over Replicate already, and then it is left as it is."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    param = nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Replicate()]))
    param.grad = DTensor.from_local(torch.full((4,), 2.0), mesh, [Partial()])  # the older torch's
    compat.settle_gradients([param])
    assert param.grad.placements == (Replicate(),)
    torch.nn.utils.clip_grads_with_norm_([param], 1.0, torch.tensor(4.0))
    torch.testing.assert_close(param.grad.full_tensor(), torch.full((4,), 0.5), rtol=1e-5, atol=0)

    newer = DTensor.from_local(torch.full((4,), 2.0), mesh, [Replicate()])
    param.grad = newer
    compat.settle_gradients([param])
    assert param.grad is newer
