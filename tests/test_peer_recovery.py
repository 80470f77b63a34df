"""Recovery from live replicas (issue 34): a failed rank's replacement takes its state from a rank of another
data-parallel replica, the survivors keep theirs in memory, and no checkpoint is read. Shown against an
uninterrupted run of the same config: every step's loss and the final weights equal to the last bit, and the
steps executed over all attempts at most max_steps plus one per failure (only the step in flight redone)."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    REPO,
    assert_logged_as,
    final_weights,
    in_background,
    logged,
    logged_step,
    make_config,
    when,
    workers,
)

from distrain.driver.launch import train
from distrain.storage.tracking import SUMMARY_FILE

pytestmark = pytest.mark.usefixtures("ray_cluster")
STEPS = 16
# Every run here asks for the same workers (4 and a hot spare, the folder of dropout_model.py on their path): one
# run's workers, kept (cluster.reuse_workers), are the next one's, and a test starts only the processes its kills
# end. The spare holds no rank: an uninterrupted run's arithmetic is the same with it.
WORKERS = ["cluster.num_workers=4", "cluster.spares=1", f"+cluster.env_vars.PYTHONPATH={REPO / 'tests'}"]
COMMON = [*WORKERS, f"trainer.max_steps={STEPS}", "checkpoint.interval=0", "cluster.restart_backoff_s=0"]
LAYOUTS = {
    "ddp": [],
    "hsdp": ["strategy.zero=3", "strategy.dp_replicate=2", "strategy.dp_shard=2"],
    "ddp_cp": ["strategy.cp=2"],  # two replicas of a ring of two
    # A model that draws random numbers every step: the replacement must take its source's generator states.
    "ddp_dropout": ["model._target_=dropout_model.DropoutLlama"],
    # Expert parallelism borrows dp_replicate's ranks: rank 1's experts are rank 3's, not rank 0's or 2's.
    "ddp_ep": ["model=moe_nano", "model.moe.expert_dim=24", "strategy.ep=2"],
    # LoRA: the base frozen and never saved, rebuilt by the replacement; the adapters and their moments sent.
    "ddp_lora": ["finetune.lora.rank=4", "finetune.lora.alpha=8"],
}


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """Each layout's uninterrupted run: its final weights and its losses."""
    out = {}
    for name, layout in LAYOUTS.items():
        cfg = make_config(tmp_path_factory.mktemp(name), f"run.name=ref-{name}", *COMMON, *layout)
        assert train(cfg)["restarts"] == 0
        out[name] = final_weights(cfg), logged(cfg)
    return out


def summary(cfg) -> dict:
    return json.loads((Path(cfg.run_dir) / SUMMARY_FILE).read_text())


def assert_bitwise(cfg, reference: tuple[dict, dict], unlogged: bool = False) -> None:
    """Final weights and every logged loss equal to the last bit; `unlogged`: the kills came at random
    moments, and a step a recovery resumed from may have no line (conftest.assert_logged_as)."""
    weights, losses = reference
    got = final_weights(cfg)
    assert [k for k in weights if not torch.equal(got[k], weights[k])] == []
    resumed = [a["info"]["resumed_from_step"] for a in summary(cfg)["attempts"][1:]] if unlogged else []
    assert_logged_as(cfg, losses, resumed)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_killed_rank_costs_only_the_step_in_flight(tmp_path: Path, references, layout: str):
    kill = ["fault.kill_at_step=7", "fault.kill_rank=1"]
    cfg = make_config(tmp_path, f"run.name=kill-{layout}", *COMMON, *LAYOUTS[layout], *kill)
    result = train(cfg)
    s = summary(cfg)
    assert result["restarts"] == 1
    second = s["attempts"][1]
    assert second["info"] == {"resumed_from_step": 7, "resumed_from": "replicas"}
    assert s["steps_executed"] <= STEPS + 1
    assert_bitwise(cfg, references[layout])


@pytest.mark.timeout(240)
def test_a_line_only_the_survivors_read_back_is_written_by_the_new_rank_0(tmp_path: Path, references):
    """Rank 0 dies in step 7 right after its backward: step 6's loss has been summed over the ranks, and rank 0
    never wrote it. The survivors read it back and carry it; the new rank 0 writes it. (Step 7's own line, which
    its sum needed rank 0 for, no rank can know: the one a recovery resumed from may be missing.)"""
    kill = ["fault.kill_at_step=7", "fault.kill_rank=0", "fault.kill_after_backward=true"]
    cfg = make_config(tmp_path, "run.name=line", *COMMON, *kill)
    assert train(cfg)["restarts"] == 1
    assert summary(cfg)["attempts"][1]["info"] == {"resumed_from_step": 7, "resumed_from": "replicas"}
    assert 6 in logged(cfg)
    assert_bitwise(cfg, references["ddp"], unlogged=True)


@pytest.mark.timeout(240)
def test_a_failure_inside_every_update_falls_back_to_the_checkpoint(tmp_path: Path, references):
    """Every rank fails inside step 7's optimizer update (as an out-of-memory there would): no rank holds a whole
    state, so none is kept for a recovery from replicas, and the run restarts from its last checkpoint (step 4)."""
    faults = [
        "fault.kill_at_step=7",
        "fault.fail_in_update=true",
        "checkpoint.interval=4",
        "checkpoint.async_save=false",
    ]
    cfg = make_config(tmp_path, "run.name=torn", *COMMON, *faults)
    assert train(cfg)["restarts"] == 1
    assert summary(cfg)["attempts"][1]["info"]["resumed_from_step"] == 4
    assert_bitwise(cfg, references["ddp"])


@pytest.mark.timeout(240)
def test_survivors_slow_to_return_are_waited_for_and_recovered_from(tmp_path: Path, references):
    """On a loaded machine a survivor's way back (its state kept, its process group left, its garbage collected)
    takes seconds: here 6 s more, twice the grace a rank still in its step gets. The supervisor waits for each
    survivor that said it is returning, and the run recovers from their memory, bitwise."""
    kill = ["fault.kill_at_step=7", "fault.kill_rank=1", "fault.slow_return_s=6"]
    cfg = make_config(tmp_path, "run.name=slow", *COMMON, *kill)
    assert train(cfg)["restarts"] == 1
    assert summary(cfg)["attempts"][1]["info"] == {"resumed_from_step": 7, "resumed_from": "replicas"}
    assert_bitwise(cfg, references["ddp"])


@pytest.mark.timeout(240)
def test_a_survivor_that_never_returns_is_named_and_the_run_goes_on_from_the_checkpoint(tmp_path: Path, capfd):
    """Survivors still on their way back past the step limit (4 s here) are ended with the attempt, each named in
    one line with what it was doing (a rank whose ring neighbours hold their connections open is still in its
    step); without their memory the run restarts from its last checkpoint."""
    kill = ["fault.kill_at_step=7", "fault.kill_rank=1", "fault.slow_return_s=600", "cluster.hang_timeout_s=4"]
    cfg = make_config(tmp_path, "run.name=gone", *COMMON, *kill, "checkpoint.interval=4", "checkpoint.async_save=false")
    assert train(cfg)["restarts"] == 1
    assert summary(cfg)["attempts"][1]["info"]["resumed_from_step"] == 4
    said = capfd.readouterr()
    lines = [line for line in (said.out + said.err).splitlines() if "did not return within" in line]
    assert {line.split(" (pid ")[0].split("rank ")[-1] for line in lines} == {"0", "2", "3"}, lines
    assert all(
        line.endswith("of the failure (leaving its process group): it is ended with the attempt")
        or line.endswith("of the failure (still in its step): it is ended with the attempt")
        for line in lines
    ), lines
    assert any("(leaving its process group)" in line for line in lines), lines
    assert "distrain: attempt 2 starts from the checkpoint of step 4" in said.out + said.err


@pytest.mark.timeout(120)
def test_a_stop_is_not_held_up_by_survivors_on_their_way_back(tmp_path: Path):
    """A stop (SIGTERM) while the survivors of a failure are waited for (300 s each here: the step limit) ends the
    wait within the stop's grace: the run stops, its record written, long before any survivor's limit."""
    kill = ["fault.kill_at_step=7", "fault.kill_rank=1", "fault.slow_return_s=600", "cluster.hang_timeout_s=300"]
    cfg = make_config(tmp_path, "run.name=stop", *COMMON, *kill, "cluster.stop_grace_s=3")
    run_dir = Path(cfg.run_dir)
    sent = {}

    def stop_while_waiting() -> None:
        when(lambda: logged_step(run_dir) >= 6)  # rank 1 dies after step 7: the others then sleep on their way back
        time.sleep(2.0)
        sent["at"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)

    helper = in_background(stop_while_waiting)
    result = train(cfg)
    took = time.monotonic() - sent["at"]
    helper.join(timeout=10)
    assert not helper.errors, helper.errors
    assert result["status"] == "stopped" and summary(cfg)["status"] == "stopped"
    # Not by waiting the survivors out (300 s): under DISTRAIN_TIMEOUT_SCALE=3 the test's own limit is longer.
    assert took < 150, took


@pytest.mark.timeout(240)
def test_a_kill_in_the_middle_of_the_transfer_is_recovered_from_the_replicas_again(tmp_path: Path, references):
    # Rank 1 dies after step 7; its replacement dies again halfway through receiving its state from rank 3's
    # memory. The survivors still hold theirs, untouched: the next attempt takes it from them again.
    faults = ["fault.kill_at_step=7", "fault.kill_rank=1", "fault.kill_mid_transfer=true"]
    cfg = make_config(tmp_path, "run.name=mid", *COMMON, *LAYOUTS["hsdp"], *faults)
    assert train(cfg)["restarts"] == 2
    s = summary(cfg)
    assert [a["outcome"] for a in s["attempts"]] == ["failed", "failed", "completed"]
    assert "rank 1" in s["attempts"][1]["cause"]
    assert [a["info"].get("resumed_from") for a in s["attempts"]] == [None, "replicas", "replicas"]
    assert s["attempts"][2]["info"]["resumed_from_step"] == 7
    assert s["steps_executed"] <= STEPS + 2
    assert_bitwise(cfg, references["hsdp"])


@pytest.mark.timeout(240)
def test_two_kills_in_quick_succession_are_recovered_from_the_last_replicas(tmp_path: Path, references):
    # DDP over 4: every rank a replica. Ranks 1 and 2 are killed 0.2 s apart, the second while the first
    # failure is being recovered from (or just after); the two survivors' memory still holds every shard. (A
    # second death that finds the survivors joining the new process group, where nothing can interrupt them,
    # costs their processes: that recovery falls back to the checkpoint, here step 0, still bitwise.)
    cfg = make_config(tmp_path, "run.name=two", *COMMON, "cluster.max_failures=-1")
    run_dir = Path(cfg.run_dir)

    def two_kills() -> None:
        when(lambda: logged_step(run_dir) >= 5)
        victims = workers(run_dir)
        os.kill(victims[1]["pid"], signal.SIGKILL)
        time.sleep(0.2)
        os.kill(victims[2]["pid"], signal.SIGKILL)

    helper = in_background(two_kills)
    result = train(cfg)
    helper.join(timeout=10)
    assert not helper.errors, helper.errors
    s = summary(cfg)
    assert 1 <= result["restarts"] <= 2 and s["attempts"][-1]["outcome"] == "completed"
    froms = [a["info"].get("resumed_from") for a in s["attempts"][1:]]
    assert froms[0] == "replicas", froms  # the first failure found every shard alive
    if froms == ["replicas"] * len(froms):
        assert s["steps_executed"] <= STEPS + result["restarts"]
    assert_bitwise(cfg, references["ddp"], unlogged=True)


# Each kill waits for the attempt before it to log a new step: the twenty took 30 steps in a run on a 2-core
# machine under a load average of 80 (some attempts were killed before their first step); 60 leave room for them.
CHAOS_STEPS, KILLS = 60, 20


@pytest.mark.timeout(420)
def test_twenty_kills_at_random_ranks_and_moments_lose_no_step(tmp_path: Path, references):
    reference_cfg = make_config(tmp_path, "run.name=chaos-ref", *COMMON, f"trainer.max_steps={CHAOS_STEPS}")
    train(reference_cfg)
    common = [*COMMON, f"trainer.max_steps={CHAOS_STEPS}", "cluster.max_failures=-1"]
    cfg = make_config(tmp_path, "run.name=chaos", *common)
    run_dir = Path(cfg.run_dir)
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    kills: list[int] = []

    def chaos() -> None:
        # Each kill after the attempt before it has logged a new step, at a random moment of the next one.
        for number in range(1, KILLS + 1):
            when(lambda n=number: (run_dir / "attempts" / f"{n:03d}-placement.json").exists())
            begun = logged_step(run_dir)
            when(lambda b=begun: logged_step(run_dir) > b)
            time.sleep(rng.uniform(0.0, 0.05))
            victim = rng.choice(workers(run_dir))
            os.kill(victim["pid"], signal.SIGKILL)
            kills.append(victim["rank"])

    helper = in_background(chaos)
    result = train(cfg)
    helper.join(timeout=10)
    context = f"seed {seed}, ranks killed {kills}"
    assert not helper.errors, (helper.errors, context)
    s = summary(cfg)
    assert result["restarts"] == KILLS and len(kills) == KILLS, context
    froms = [a["info"].get("resumed_from") for a in s["attempts"][1:]]
    assert froms == ["replicas"] * KILLS, (froms, context)
    assert s["steps_executed"] <= CHAOS_STEPS + KILLS, context
    assert_bitwise(cfg, (final_weights(reference_cfg), logged(reference_cfg)), unlogged=True)
