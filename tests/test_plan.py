"""`--plan`: the layout text from fake rank tables (no Ray), then the entrypoint end to end: from the config
alone without a cluster to attach to (no Ray cluster starts), placed on one. The memory estimate's numbers
are checked against a measured training step in test_memory.py, not here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY, fake_table, make_config
from test_refusals import HUGE, without_ray

from distrain.config import TrainConfig
from distrain.driver.cli import plan_overrides
from distrain.driver.launch import train
from distrain.driver.plan import describe, rank_memory, stage_params
from distrain.driver.validation import validate
from distrain.model.registry import build_model
from distrain.model.size import num_params
from distrain.strategy import MESH_DIMS
from distrain.strategy.layout import Layout
from distrain.strategy.resolve import single


def planned(tmp_path: Path, *overrides: str) -> tuple[TrainConfig, Layout]:
    cfg = make_config(tmp_path, *overrides)
    return cfg, validate(cfg)


@pytest.mark.timeout(60)
def test_the_loss_logits_are_what_a_step_holds(tmp_path: Path):
    """The plan's logits term against a step's peak of live tensor bytes (jobs/bench/bench_loss.py's measure, one
    process): doubling the vocabulary adds what the term adds, within 5% (measured 2%: 12.25 bytes a logit against
    the plan's 12); only the last pipeline stage holds them; trainer.loss_chunk keeps one slice's."""
    sys.path.insert(0, str(REPO / "jobs" / "bench"))
    import bench_loss

    seq, peak, plan = 512, {}, {}
    for vocab in (4096, 8192):
        model = {"dim": 32, "n_layers": 1, "n_heads": 2, "ffn_dim": 64, "vocab_size": vocab}
        peak[vocab] = bench_loss.measure(model, seq, 0, 1)["peak"]
        cfg, layout = planned(tmp_path, "cluster.num_workers=1", f"trainer.seq_len={seq}", "trainer.micro_batch_size=1")
        cfg.model.vocab_size = vocab
        plan[vocab] = rank_memory(cfg, layout, 0, "fp32").logits
    assert peak[8192] - peak[4096] == pytest.approx(plan[8192] - plan[4096], rel=0.05)
    cfg, layout = planned(tmp_path, "cluster.num_workers=2", "strategy=pp")
    first, last = (rank_memory(cfg, layout, r, "fp32").logits for r in (0, 1))
    assert first == 0 and last > 0
    chunked = planned(tmp_path, "cluster.num_workers=2", "strategy=pp", "trainer.loss_chunk=4")[0]
    assert rank_memory(chunked, layout, 1, "fp32").logits * 16 == last  # 4 targets of 2 sequences: 2 of 32 positions
    assert "the loss's logits" in describe(cfg, layout, None)


@pytest.mark.timeout(30)
def test_3d_mesh_coordinates_and_groups(tmp_path: Path):
    overrides = ("cluster.num_workers=8", "strategy=3d", "model.n_layers=4", "trainer.precision=auto")
    cfg, layout = planned(tmp_path, *overrides)
    text = describe(cfg, layout, fake_table(8, per_node=4, gpus=True))
    lines = text.splitlines()

    header = lines.index("mesh:") + 1
    assert lines[header].split()[-5:] == list(MESH_DIMS)
    for r in range(8):
        row = lines[header + 1 + r].split()
        assert row[:3] == [str(r), str(7 - r), str(1000 + r)]
        assert row[3:7] == [f"10.0.0.{r // 4 + 1}", f"#{r // 4}", "GPU", str(r % 4)]
        assert row[7:] == [str(r // 4), "0", str(r // 2 % 2), "0", str(r % 2)]  # pp, dp_replicate, dp_shard, cp, tp

    assert "  pp: [0,4] [1,5] [2,6] [3,7]" in lines
    assert "  dp_shard: [0,2] [1,3] [4,6] [5,7]" in lines
    assert "  tp: [0,1] [2,3] [4,5] [6,7]" in lines
    assert not any(line.startswith("  dp_replicate:") for line in lines)  # size 1: no groups
    assert "2 nodes, GPU, bf16" in lines[0]  # precision auto on GPUs
    assert len([line for line in lines if line.startswith("  pp rank ")]) == 2  # memory for each stage
    # A layout reads its dims and settings by name, and a name no parallelism registered is an error, not a None.
    assert (layout.pp, layout.tp, layout.schedule) == (2, 2, layout.settings["schedule"])
    with pytest.raises(AttributeError, match="a layout has no dim or setting 'tpp'"):
        layout.tpp  # noqa: B018


@pytest.mark.timeout(30)
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_the_plan_names_the_strategy_and_its_memory(tmp_path: Path, strategy: str):
    cfg, layout = planned(tmp_path, "cluster.num_workers=4", f"strategy={strategy}")
    text = describe(cfg, layout, fake_table(4, 4, gpus=False))
    assert f"strategy {strategy} (zero {cfg.strategy.zero})" in text
    assert "4 ranks on 1 node, CPU, fp32" in text
    memory = [line for line in text.splitlines() if line.startswith("  every rank: params ")]
    assert len(memory) == 1 and "(1 micro-batch in flight)" in memory[0]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("strategy", ["offload", "nvme"])
def test_offload_says_where_the_state_lives(tmp_path: Path, strategy: str):
    cfg, layout = planned(tmp_path, "cluster.num_workers=4", f"strategy={strategy}", f"strategy.nvme_path={tmp_path}")
    mem = rank_memory(cfg, layout, 0, "fp32")
    assert mem.offload == cfg.strategy.offload and mem.params > 0
    assert mem.device_total == mem.activations + mem.logits  # the model state is not on the device
    text = describe(cfg, layout, fake_table(4, 4, gpus=True))
    assert f"(zero 3, offload {mem.offload})" in text
    where = f"the optimizer state in files under {tmp_path}/distrain-{cfg.run.name}"
    assert ("optimizer state sit in CPU memory" in text) == (strategy == "offload")
    assert (where in text) == (strategy == "nvme")


@pytest.mark.timeout(30)
def test_a_parameter_server_plan_shows_the_servers_not_process_groups(tmp_path: Path):
    cfg, layout = planned(tmp_path, "strategy=ps", "ps=async", "ps.num_servers=2", "cluster.num_workers=4")
    text = describe(cfg, layout, fake_table(4, 4, gpus=False))
    assert "process groups" not in text
    assert "parameter servers: 2, mode async" in text
    per_server = num_params(cfg.model, cfg.trainer.seq_len) * 4 / 2 / 1024  # KiB of fp32 weights each
    assert f"each server: params {per_server:.1f} KiB, optimizer {2 * per_server:.1f} KiB" in text
    assert "optimizer 0 B" in text  # the workers hold none


@pytest.mark.timeout(30)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_pipeline_stages_list_their_layers(family: str, tmp_path: Path):
    model_override = (
        ["model=gpt2_nano", "model.dim=32", "model.n_heads=2", "model.ffn_dim=64"] if family == "gpt2" else []
    )
    cfg, layout = planned(
        tmp_path,
        *model_override,
        "cluster.num_workers=2",
        "strategy=pp",
        "strategy.schedule=interleaved_1f1b",
        "model.n_layers=6",
    )
    text = describe(cfg, layout, fake_table(2, 2, gpus=False))
    assert "pipeline (interleaved_1f1b, 4 stages, 4 micro-batches per step):" in text
    stages = [line.strip() for line in text.splitlines() if line.startswith("  stage ")]
    assert stages == [
        "stage 0 on pp rank 0: embedding, layer 0",
        "stage 2 on pp rank 0: layers 3-4",
        "stage 1 on pp rank 1: layers 1-2",
        "stage 3 on pp rank 1: layer 5, norm, output",
    ]
    # Each stage's parameter count is that of the real model's parts the listing names; a tied head is
    # a copy of its own on the last stage (named_parameters without removing the duplicate).
    model = build_model(cfg.model, cfg.trainer.seq_len)
    owned = {
        0: ("tok_embeddings.", "pos_embeddings.", "layers.0."),
        1: ("layers.1.", "layers.2."),
        2: ("layers.3.", "layers.4."),
        3: ("layers.5.", "norm.", "output."),
    }
    for stage, prefixes in owned.items():
        named = model.named_parameters(remove_duplicate=False)
        counted = sum(p.numel() for name, p in named if name.startswith(prefixes))
        assert stage_params(cfg, stage, 4, single()) == counted, f"stage {stage}"
    # pp rank 1 holds stages 1 and 3: its fp32 parameters are theirs.
    assert rank_memory(cfg, layout, 1, "fp32").params == 4 * sum(
        p.numel() for name, p in model.named_parameters(remove_duplicate=False) if name.startswith(owned[1] + owned[3])
    )


@pytest.mark.timeout(30)
def test_plan_switch_becomes_an_override():
    assert plan_overrides(["--plan", "strategy=tp"]) == ["plan=true", "strategy=tp"]
    assert plan_overrides(["strategy=tp"]) == ["strategy=tp"]


def run_plan(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`jobs/train.py --plan` in a fresh process, on an embedded cluster of a stated size (2 CPUs,
    no GPU) whatever the machine has: 4 workers of 0.25 CPU fit."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    cluster = ["cluster.local_cpus=2", "cluster.local_gpus=0"]
    args = [*TINY, *cluster, f"run.storage={tmp_path}", "cluster.num_workers=4", *overrides]
    return subprocess.run(
        [sys.executable, str(REPO / "jobs" / "train.py"), "--plan", *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env=env,
    )


@pytest.mark.timeout(200)
def test_plan_end_to_end_writes_nothing(tmp_path: Path):
    result = run_plan(tmp_path, "strategy=fsdp_tp")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "  tp: [0,1] [2,3]" in lines and "  dp_shard: [0,2] [1,3]" in lines
    assert any(line.startswith("  every rank: params ") for line in lines)
    assert list(tmp_path.iterdir()) == []  # no run directory, lock, Hydra record or log


@pytest.mark.timeout(200)
def test_plan_of_an_impossible_layout_fails_in_one_line(tmp_path: Path):
    result = run_plan(tmp_path, "strategy.tp=3")
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("distrain: error:")]
    assert len(errors) == 1 and "strategy" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(300)
def test_a_plan_without_a_cluster_to_attach_to_starts_none(tmp_path: Path):
    """From the config and this machine alone: the ranks' coordinates (not which node and GPU, which only
    placement tells), and what the memory check would do; GPUs as nvidia-smi lists them (a fake one on PATH
    here: 80 and 40 GiB) for cluster.use_gpu=null; a cluster the machine cannot be is refused as a run is."""
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nprintf '81920\\n40960\\n'\n")
    fake.chmod(0o755)
    storage = tmp_path / "runs"
    plans = without_ray(
        storage,
        ["plan=true", "strategy=fsdp_tp", "cluster.num_workers=4", "cluster.local_cpus=2"],
        ["plan=true", *HUGE],
        ["plan=true", "cluster.use_gpu=null", "trainer.precision=auto"],
        ["plan=true", "cluster.num_workers=64", "trainer.global_batch_size=128", "cluster.local_cpus=2"],
        env={"PATH": f"{fake.parent}:{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": "0,1"},
    )
    lines = plans[0].splitlines()
    assert lines[0].startswith("distrain plan: 4 ranks not placed, CPU, fp32; strategy fsdp_tp"), lines[0]
    assert lines[lines.index("mesh:") + 1].split() == ["rank", *MESH_DIMS]
    assert "  not placed: this machine's embedded Ray cluster (2 CPUs, 2 GPUs) would run every rank" in plans[0]
    assert "  tp: [0,1] [2,3]" in lines and "  dp_shard: [0,2] [1,3]" in lines
    assert any(line.startswith("memory check: passes: each rank needs an estimated ") for line in lines)
    refused = [line for line in plans[1].splitlines() if line.startswith("memory check:")]
    assert refused[0].startswith("memory check: the run would be refused: each rank needs an estimated "), refused
    assert plans[2].startswith("distrain plan: 2 ranks not placed, GPU, bf16"), plans[2]
    assert "and the smallest GPU has 40.0 GiB (nvidia-smi on this machine)" in plans[2]
    assert plans[3].startswith("CapacityError: cluster.num_workers=64 needs 16 CPU"), plans[3]
    assert not storage.exists()  # nothing written


@pytest.mark.timeout(120)
def test_a_plan_on_a_cluster_places_the_workers(tmp_path: Path, ray_cluster):
    """With a cluster (attached to, or up in the process), the workers are placed and let go: the table says
    which node and device holds each rank, and the memory check is the cluster's."""
    text = train(make_config(tmp_path, "plan=true", "strategy=fsdp_tp", "cluster.num_workers=4"))["plan"]
    lines = text.splitlines()
    assert lines[0].startswith("distrain plan: 4 ranks on 1 node, CPU, fp32"), lines[0]
    rows = lines[lines.index("mesh:") + 2 : lines.index("mesh:") + 6]
    assert [row.split()[3:5] for row in rows] == [["127.0.0.1", "#0"]] * 4
    assert "(Ray's memory and object store on 127.0.0.1)" in text and "not placed" not in text
    assert list(tmp_path.iterdir()) == []
