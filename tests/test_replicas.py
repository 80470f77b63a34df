"""Recovery from live replicas without Ray (issue 34): the driver's plan of who sends each rank its state, and on
two gloo ranks the transfer from a replica and the digests that show the replicas equal, made to differ by one bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from conftest import fake_table, free_port, rank_env

from distrain.driver.collective import replicas_plan
from distrain.driver.survival import survivable
from distrain.strategy.resolve import layout_of

HSDP = layout_of(pp=1, dp_replicate=2, dp_shard=2, tp=1)  # shards: ranks 0 and 2 hold one, 1 and 3 the other


def offer(rank: int, step: int = 9, run: str = "r", world: int = 4) -> dict:
    return {"run": run, "rank": rank, "world": world, "step": step, "lines": {}}


def test_the_plan_takes_each_rank_from_itself_or_a_replica_of_its_shard_at_the_newest_step():
    plan, why = replicas_plan(HSDP, {0: offer(0), 2: offer(2), 3: offer(3)}, "r", 1)
    assert plan.sources == (0, 3, 2, 3) and plan.step == 9  # rank 1's shard from rank 3, the others their own
    assert "rank 1 from rank 3" in why and "no checkpoint read" in why
    # A survivor behind the others (its update of step 9 never finished) takes the newer state too.
    plan, _ = replicas_plan(HSDP, {0: offer(0), 1: offer(1, step=8), 2: offer(2), 3: offer(3)}, "r", 1)
    assert plan.sources == (0, 3, 2, 3)
    # Sending is spread: in DDP over 4, two replacements take theirs from two different survivors.
    ddp = layout_of(pp=1, dp_replicate=4, dp_shard=1, tp=1)
    plan, _ = replicas_plan(ddp, {0: offer(0), 3: offer(3)}, "r", 1)
    assert plan.sources[0] == 0 and plan.sources[3] == 3 and sorted(plan.sources[1:3]) == [0, 3]


@pytest.mark.parametrize(
    ("kept", "said"),
    [
        ({0: offer(0), 2: offer(2)}, "no surviving rank holds rank 1's shard (pp 0, dp_shard 1, cp 0, tp 0) at step 9"),
        ({0: offer(0), 1: offer(1, step=8), 2: offer(2)}, "rank 1's shard"),  # its only copy is behind
        ({0: offer(0, run="other"), 1: None}, "no surviving rank kept a whole training state"),
        ({0: offer(0, world=2), 1: offer(1, world=2)}, "no surviving rank kept a whole training state"),
    ],
    ids=["every copy of a shard lost", "a copy behind", "another run's workers", "another world size"],
)
def test_no_plan_without_every_shard_at_one_step_of_this_run(kept: dict, said: str):
    plan, why = replicas_plan(HSDP, kept, "r", 1)
    assert plan is None and said in why


def test_the_plan_says_which_lost_hosts_a_layout_survives_without_a_checkpoint():
    two_hosts = fake_table(4, 2, gpus=False)  # ranks 0-1 on one host, 2-3 on the other
    lines = survivable(HSDP, two_hosts)
    assert "any 1 rank lost cost only the step in flight" in lines[0] and "replica 1: ranks 2-3" in lines[0]
    assert [line.endswith("the step in flight") for line in lines[1:]] == [True, True]  # a replica per host
    # dp_shard outermost of the two would put a shard's both copies on one host: then a host is not survivable.
    across = layout_of(pp=1, dp_replicate=2, dp_shard=2, tp=1)
    lines = survivable(across, [dict(e, rank=r) for r, e in zip([0, 2, 1, 3], two_hosts, strict=True)])
    assert all(line.endswith("a restart from the last checkpoint") for line in lines[1:])
    assert "no data-parallel replica" in survivable(layout_of(pp=1, dp_replicate=1, dp_shard=4, tp=1), two_hosts)[0]


# -- the transfer and the digests, on two gloo ranks ----------------------------------------------------------


def state(seed: int) -> dict:
    """A flat training state as the trainer's (replicas.flatten): fp32 weights, an int64 step, a bf16 moment."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model/w": torch.randn(3, 5, generator=g),
        "optim/w.step": torch.tensor(7),
        "optim/w.exp_avg": torch.randn(3, 5, generator=g).bfloat16(),
    }


def flip_one_bit(t: torch.Tensor) -> None:
    t.view(-1).view(torch.uint8)[3] ^= 1


def rank_main(rank: int, port: int, out: str) -> None:
    """Rank 0 holds its state in memory from a failed attempt, rank 1 is its replacement: the plan names rank 0
    the source of both. Then the replicas are compared: equal; one bit of one tensor flipped on rank 1; the same
    tensors compared as two shards of their own (each its only replica)."""
    rank_env(rank, 2, port)
    from distrain.parallel import process_group
    from distrain.train import replicas

    process_group.init_from_env()
    extras = {"rng": torch.get_rng_state(), "loss": 1.5}
    own = replicas.KeptState("r", 0, 2, 7, state(0), extras, {}) if rank == 0 else None
    fresh = {key: torch.zeros_like(t) for key, t in state(1).items()}
    extras = replicas.fill(fresh, (0, 0), rank, own, midway=lambda: None)
    verdicts = []
    for part, shard in (("model/w", (0,)), ("optim/w.exp_avg", (0,)), ("model/w", (rank,))):
        if rank == 1 and shard == (0,):
            flip_one_bit(fresh[part])
        try:
            replicas.check_replicas(fresh, shard, 7)
            verdicts.append(None)
        except replicas.ReplicaMismatchError as e:
            verdicts.append(str(e))
        if rank == 1 and shard == (0,):
            flip_one_bit(fresh[part])  # back as it came
    torch.save({"state": fresh, "extras": extras, "verdicts": verdicts}, Path(out, f"rank{rank}.pt"))
    process_group.destroy()


@pytest.mark.timeout(120)
def test_a_replacement_takes_a_replicas_state_and_one_flipped_bit_is_refused(tmp_path: Path):
    mp.spawn(rank_main, args=(free_port(), str(tmp_path)), nprocs=2)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in range(2):  # both hold rank 0's state, bit for bit, and its extras
        assert all(torch.equal(got[r]["state"][k], t) for k, t in state(0).items())
        assert got[r]["extras"]["loss"] == 1.5
    assert torch.equal(got[1]["extras"]["rng"], got[0]["extras"]["rng"])
    mismatch = "after recovering from replicas at step 7, the replicas of shard (0,) hold different state"
    for r in range(2):  # every rank raises, on a weight's bit and on an optimizer moment's alike
        assert got[r]["verdicts"] == [mismatch, mismatch, None], got[r]["verdicts"]
