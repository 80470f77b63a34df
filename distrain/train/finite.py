"""A loss or gradient norm that is not finite ends the run before anything after it is saved.

A NaN or inf does not heal: every step after it trains on NaN weights, and a checkpoint of them would be
resumed from, kept by retention and exported. The trainer notes each step's on the device, without waiting
for it (`NonFinite.watch`); the ranks compare notes whenever they read a logged step's scalars back and
before every save (`NonFinite.check`, a collective), and all raise NonFiniteLossError together.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distrain.config import TrainConfig, resolve_precision

NEVER = 2**62  # the note of a run whose every step was finite


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient norm was NaN or inf at a step. Retrying from the last checkpoint reaches it
    again (a step's batch is a function of the seed and the step), so the run ends at once."""

    permanent = True  # read by the supervisor: the run ends at once, with this error's one line


class NonFinite:
    def __init__(self, device: torch.device):
        self.first = torch.full((), NEVER, dtype=torch.int64, device=device)

    def watch(self, step: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Note `step` if this rank's loss or the gradient norm is not finite (on the device: no wait)."""
        at = self.first.device
        finite = torch.isfinite(loss_sum.detach().to(at)) & torch.isfinite(grad_norm.detach().to(at))
        self.first = torch.where(finite, self.first, self.first.clamp(max=step))

    def check(self, cfg: TrainConfig, gpu: bool) -> None:
        """Collective: NonFiniteLossError on every rank if any rank noted a step, naming the first."""
        first = self.first.clone()
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        step = int(first.item())
        if step < NEVER:
            raise NonFiniteLossError(advice(step, cfg, gpu))


def advice(step: int, cfg: TrainConfig, gpu: bool) -> str:
    """The error's one line: the step, that nothing from it on was saved, and the knobs that usually help."""
    o, precision = cfg.optim, resolve_precision(cfg.trainer.precision, gpu)
    tries = [f"a lower optim.lr (now {o.lr:g})", f"a longer optim.warmup_steps (now {o.warmup_steps})"]
    if o.grad_clip <= 0:
        tries.append("gradient clipping (optim.grad_clip=1.0; now off)")
    if precision == "bf16":
        tries.append("trainer.precision=fp32 (now bf16)")
    return (
        f"the loss or the gradient norm was not finite (NaN or inf) at step {step}; nothing from step {step} "
        f"on was saved (a rerun resumes from the checkpoint before it). Try {', '.join(tries[:-1])} or {tries[-1]}"
    )
