"""The chunked loss (trainer.loss_chunk, distrain/parallel/chunked_loss.py): the head and cross-entropy a slice of
the sequence at a time give today's loss to 1e-6 (relative: at a loss of 5.5 the runs below differ by at most
9.5e-7, two fp32 roundings) and its gradients to 1e-5 (relative), in one process (each
parameter's gradient, Llama and GPT-2's tied head) and on every layout that computes a loss (DDP, ZeRO-3,
1-D tensor parallelism with the vocabulary-parallel loss and with gathered logits, the 2-D grid, the pipeline's
last stage with a tied head, context parallelism): 4 gloo ranks in one spawn, each layout trained 2 steps with and
without chunks, compared rank by rank. The slices are uneven (20 tokens of 2 rows: 10, 10, 10, 2 positions)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import free_port, make_config, rank_env, spawn_ranks
from test_context_parallel import batches, built, train_steps
from torch import nn

WORLD = 4
STEPS = 2
CHUNK = "trainer.loss_chunk=20"  # 2 rows a micro-batch: 10 positions a slice, the last of 2
LOSS_TOL, GRAD_TOL = 1e-6, 1e-5
GPT2 = ("model=gpt2_nano", "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.ffn_dim=64")
LAYOUTS = {
    # id: overrides, on 4 ranks
    "ddp": ("strategy=ddp",),
    "zero3_gpt2": ("strategy=zero3", *GPT2),  # the tied head and embedding in one FSDP unit, called once a slice
    "tp_dp": ("strategy=tp",),  # the vocabulary-parallel loss (loss_parallel) on sequence-parallel hidden states
    "tp_gathered": ("strategy=tp", "strategy.loss_parallel=false"),
    "tp2d": ("strategy=tp2d",),  # the grid's loss
    "pp_gpt2": ("strategy=pp", *GPT2),  # the last stage's loss, the head a copy of the first stage's embedding
    "cp2": ("strategy.cp=2",),
}


def losses_and_grads(overrides: tuple[str, ...], tmp_path: Path) -> list[tuple[torch.Tensor, dict, int]]:
    """One process, built as a parameter-server worker builds it (a Learner: trainer.loss_chunk reaches the model
    from the config): one step's loss, each parameter's gradient and the bytes saved for the backward, without and
    with chunks."""
    from distrain.parallel.traffic import saved_activations
    from distrain.strategy.resolve import single
    from distrain.train.faults import Faults
    from distrain.train.learner import Learner

    (tmp_path / "corpus").mkdir(exist_ok=True)
    (tmp_path / "corpus" / "text.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    got = []
    for chunk in (0, 20):
        cfg = make_config(tmp_path, *overrides, "model.vocab_size=1000", f"trainer.loss_chunk={chunk}")
        cfg.data.path = str(tmp_path / "corpus")
        learner = Learner(cfg, single(1), (0, 1), torch.device("cpu"), Faults(cfg.fault, 0, None), collective=False)
        parallel = learner.parallel
        x = torch.randint(0, 1000, (2, cfg.trainer.seq_len + 1), generator=torch.Generator().manual_seed(0))
        with saved_activations(parallel.module) as held:
            loss = parallel.loss_fn(parallel.module(x[:, :-1]), x[:, 1:])
        loss.backward()
        grads = {name: p.grad for name, p in parallel.module.named_parameters()}
        got.append((loss.detach(), grads, held["bytes"]))
    return got


@pytest.mark.parametrize("model", [(), GPT2], ids=["llama", "gpt2_tied"])
def test_one_process_gives_todays_loss_and_gradients_without_holding_the_logits(model: tuple, tmp_path: Path):
    (whole, want, whole_bytes), (loss, grads, chunked_bytes) = losses_and_grads(model, tmp_path)
    assert loss.item() == pytest.approx(whole.item(), rel=LOSS_TOL, abs=LOSS_TOL)
    assert grads.keys() == want.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want[name], rtol=GRAD_TOL, atol=1e-8, msg=name)
    logits = 2 * 32 * 1000 * 4  # the micro-batch's fp32 logits, which the whole loss keeps for its backward
    assert chunked_bytes + logits <= whole_bytes, (chunked_bytes, whole_bytes)


def test_a_model_that_cannot_leave_its_head_is_refused_in_one_line():
    from distrain.parallel.chunked_loss import chunked
    from distrain.train.learner import cross_entropy

    model = nn.Sequential(nn.Linear(4, 4))
    model.output_modules = ("0",)
    with pytest.raises(ValueError, match=r"trainer.loss_chunk=8: Sequential cannot leave its head to the loss"):
        chunked([model], cross_entropy, 8)


def rank_main(rank: int, port: int, cases: dict, out: str) -> None:
    rank_env(rank, WORLD, port, CUDA_VISIBLE_DEVICES="")
    from distrain.parallel import process_group

    device = process_group.init_from_env()
    results = {}
    for name, modes in cases.items():
        for mode, case in modes.items():
            cfg, layout, parallel = built(case, device)
            losses, norms = train_steps(parallel, layout, batches(cfg)[:STEPS], layout.data_shard(rank))
            means = [float(x) / layout.micro_batches for x in losses]  # a micro-batch's mean loss (0: no last stage)
            results[f"{name}/{mode}"] = {"loss": means, "grad_norm": norms}
    torch.save(results, Path(out, f"rank{rank}.pt"))
    process_group.destroy()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    from distrain.config import to_plain
    from distrain.driver.validation import validate

    tmp = tmp_path_factory.mktemp("chunked")
    cases = {}
    for name, overrides in LAYOUTS.items():
        cases[name] = {}
        for mode, extra in (("whole", ()), ("chunked", (CHUNK,))):
            cfg = make_config(tmp, f"cluster.num_workers={WORLD}", *overrides, *extra)
            cases[name][mode] = (to_plain(cfg), validate(cfg).as_dict())
    spawn_ranks(rank_main, (free_port(), cases, str(tmp)), WORLD)
    return [torch.load(tmp / f"rank{rank}.pt") for rank in range(WORLD)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_gives_todays_loss_and_gradient_norm(layout: str, runs: list[dict]):
    for rank, got in enumerate(runs):
        whole, chunked = got[f"{layout}/whole"], got[f"{layout}/chunked"]
        for step, (a, b) in enumerate(zip(chunked["loss"], whole["loss"], strict=True), 1):
            assert a == pytest.approx(b, rel=LOSS_TOL, abs=LOSS_TOL), f"rank {rank} step {step}: loss {a} vs {b}"
        for step, (a, b) in enumerate(zip(chunked["grad_norm"], whole["grad_norm"], strict=True), 1):
            assert a == pytest.approx(b, rel=GRAD_TOL), f"rank {rank} step {step}: grad norm {a} vs {b}"
