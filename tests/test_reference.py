"""An independent reference: the same model on the same batches, trained by a plain PyTorch loop
written here, against distrain on 1 worker and on 4 (DDP).

Every other parity test compares distrain with distrain, so a mistake shared by all of its layouts
(the loss averaging over micro-batches, gradient clipping, the optimizer's parameter groups, the
learning-rate schedule) would pass them all. Only the model class and the batches are shared; the
loop, the averaging, the clipping, the two AdamW groups and the schedule below follow what docs/configuration.md
and `OptimConfig` document, not distrain's code:

- the loss of a step is the mean over the global batch; with equal micro-batches, the mean of their means;
- the gradient is clipped by its global L2 norm to `optim.grad_clip` (scale max/(norm + 1e-6) when below 1);
- AdamW decays matrices (embeddings, projections, head) by `optim.weight_decay`, vectors (norm gains,
  biases) not at all;
- the LR rises linearly over `warmup_steps` (lr·k/warmup at step k, steps counted from 1), then
  follows a cosine from lr to lr·min_lr_ratio at `decay_steps` (`max_steps` when unset).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import final_weights, logged, make_config

from distrain.config import TrainConfig
from distrain.data.loader import run_batches
from distrain.driver.launch import train
from distrain.model.registry import build_model

STEPS = 12
# grad_clip 1.5 sits inside the tiny model's range of gradient norms over these steps (1.16 to 2.36):
# clipping scales 8 of the 12 steps and leaves 4 alone, so both branches are exercised.
# Weight decay 0.1 and the schedule of docs/configuration.md; warmup 2 steps (conftest's TINY).
OVERRIDES = ("strategy=ddp", f"trainer.max_steps={STEPS}", "optim.grad_clip=1.5")


def reference_lr(step: int, cfg: TrainConfig) -> float:
    o = cfg.optim
    if step <= o.warmup_steps:
        return o.lr * step / o.warmup_steps
    end = o.decay_steps or cfg.trainer.max_steps
    progress = min((step - o.warmup_steps) / (end - o.warmup_steps), 1.0)
    floor = o.lr * o.min_lr_ratio
    return floor + (o.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def reference_training(cfg: TrainConfig) -> tuple[dict[str, list[float]], dict[str, torch.Tensor]]:
    """Per-step loss, gradient norm (before clipping) and LR, and the final weights, of a plain loop
    over the whole global batch in one process."""
    o, t = cfg.optim, cfg.trainer
    model = build_model(cfg.model, t.seq_len, seed=t.seed)  # distrain's initial weights
    batches, _ = run_batches(cfg)

    vector = ("norm.weight", "norm.bias", ".bias")
    gains = [p for name, p in model.named_parameters() if name.endswith(vector)]
    matrices = [p for name, p in model.named_parameters() if not name.endswith(vector)]
    assert all(p.ndim == 1 for p in gains) and all(p.ndim == 2 for p in matrices)
    assert any(name.endswith("norm.weight") for name, _ in model.named_parameters())
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": o.weight_decay}, {"params": gains, "weight_decay": 0.0}],
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
    )
    n_micro = t.global_batch_size // t.micro_batch_size
    record: dict[str, list[float]] = {"loss": [], "grad_norm": [], "lr": []}
    for step in range(1, t.max_steps + 1):
        lr = reference_lr(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = batches.get(step)  # the whole global batch `step`
        optimizer.zero_grad(set_to_none=True)
        losses = []
        for xm, ym in zip(x.split(t.micro_batch_size), y.split(t.micro_batch_size), strict=True):
            logits = model(xm)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ym.reshape(-1))
            (loss / n_micro).backward()
            losses.append(loss.item())
        norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
        scale = o.grad_clip / (norm + 1e-6)
        if scale < 1.0:
            with torch.no_grad():
                for p in model.parameters():
                    p.grad.mul_(scale)
        optimizer.step()
        record["loss"].append(sum(losses) / n_micro)
        record["grad_norm"].append(norm)
        record["lr"].append(lr)
    return record, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("family", [[], ["model=gpt2_nano"]], ids=["llama", "gpt2"])
def test_distrain_trains_as_a_plain_pytorch_loop(family: list[str], tmp_path: Path):
    """fp32 on CPU. Tolerances, all absolute: 1e-5 on each step's loss (≈5.5 to 4.8) and gradient
    norm before clipping (≈1.2 to 2.4), 1e-5 on every final weight (scale 0.02 to 1), 1e-12 on the
    LR (≈1e-3; a pure function of the step). The reference and distrain do the same arithmetic in
    another order only: foreach AdamW against its per-tensor loop, the norm summed in another order,
    and on 4 workers the gloo all-reduce of 4 ranks' gradients instead of one process accumulating 4
    micro-batches. Measured, those rounding differences stay below 1e-6 over these steps (loss 5e-7,
    an fp32 ulp at 5; norm 7e-7; weights 1.2e-7; LR 1e-18), so the tolerances leave 10× room. A mistake
    in the loop lands far outside them: decay on the gains moves the loss by 1e-4 within 3 steps, an
    LR one step off by 5e-2 at step 2, an unaveraged micro-batch loss gives 4× the gradient norm."""
    reference, ref_weights = reference_training(make_config(tmp_path, *OVERRIDES, *family))
    clipped = [n > 1.5 for n in reference["grad_norm"]]
    assert any(clipped) and not all(clipped), reference["grad_norm"]  # both branches of clipping
    assert reference["loss"][-1] < reference["loss"][0] - 0.5  # and it learns

    for workers in (1, 4):
        cfg = make_config(tmp_path, *OVERRIDES, *family, f"run.name=w{workers}", f"cluster.num_workers={workers}")
        assert train(cfg)["world_size"] == workers
        for key, tol in (("loss", 1e-5), ("grad_norm", 1e-5), ("lr", 1e-12)):
            got = logged(cfg, key)
            assert sorted(got) == list(range(1, STEPS + 1))
            for step, want in enumerate(reference[key], start=1):
                assert got[step] == pytest.approx(want, abs=tol, rel=0), f"{workers} workers, {key} at step {step}"
        weights = final_weights(cfg)
        assert weights.keys() == ref_weights.keys()
        for name, want in ref_weights.items():
            torch.testing.assert_close(weights[name], want, atol=1e-5, rtol=0, msg=f"{workers} workers: {name}")
