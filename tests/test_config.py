"""Bad input: a one-line error naming the key and the fix, a non-zero exit, and no actor started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, make_config

from distrain.config import ConfigError
from distrain.driver.launch import train
from distrain.driver.validation import validate
from distrain.strategy.resolve import layout_of, smaller


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["cluster.num_workers=0"], "cluster.num_workers"),
        (
            ["cluster.num_workers=2", "trainer.global_batch_size=12", "trainer.micro_batch_size=4"],
            "trainer.global_batch_size",
        ),
        (["data.path=/nonexistent/corpus"], "data.path"),
        (["strategy.dp_replicate=3", "cluster.num_workers=2"], "strategy.dp_replicate"),
        (["strategy=fsdp_tp", "strategy.dp_shard=1", "cluster.num_workers=4"], "strategy.dp_replicate"),
        (["strategy=tp", "strategy.tp=4", "cluster.num_workers=4"], "model.n_heads"),
        (["strategy=tp", "trainer.seq_len=33"], "trainer.seq_len"),
        (["strategy=pp", "model.n_layers=1"], "model.n_layers"),
        (["strategy=pp", "strategy.schedule=interleaved_1f1b", "model.n_layers=3"], "model.n_layers"),
        (["strategy=pp", "trainer.global_batch_size=2"], "trainer.global_batch_size"),
        (["strategy=pp", "strategy.schedule=zigzag"], "strategy.schedule"),
        (["strategy=pp", "strategy.schedule=gpipe", "strategy.stages_per_rank=2"], "strategy.stages_per_rank"),
        (["strategy=zero1", "strategy.tp=2", "cluster.num_workers=4"], "strategy.zero=1"),
        (["strategy=zero1", "strategy.pp=2", "cluster.num_workers=4"], "strategy.zero=1"),
        (
            ["strategy=zero1", "strategy.dp_replicate=2", "strategy.dp_shard=2", "cluster.num_workers=4"],
            "strategy.zero=1",
        ),
        (["strategy=tp", "strategy.offload=cpu"], "strategy.offload"),
        (["strategy=offload", "strategy.pp=2"], "strategy.offload"),
        (["strategy=offload", "strategy.zero=2"], "strategy.offload"),
        (["strategy.offload=true"], "strategy.offload"),
        (["strategy=nvme", "strategy.zero=2"], "strategy.offload"),
        (["strategy=nvme", "optim=sgd"], "optim.name"),
        (["strategy=nvme", "strategy.nvme_buffer_mb=1"], "strategy.nvme_buffer_mb"),
        (["strategy=nvme", "strategy.nvme_path=/nonexistent/nvme"], "strategy.nvme_path"),
        (["strategy=tp", "model.ffn_dim=63"], "model.ffn_dim"),
        (["strategy=tp", "model.vocab_size=257"], "model.vocab_size"),
        (["strategy=tp", "model.n_heads=4", "model.n_kv_heads=1"], "model.n_kv_heads"),
        (["strategy.zero=4"], "strategy.zero"),
        (["strategy=pp", "strategy.stages_per_rank=0"], "strategy.stages_per_rank"),
        (["strategy.dp_shard=-1"], "strategy.dp_replicate and strategy.dp_shard"),
        (
            ["strategy=pp", "strategy.schedule=interleaved_1f1b", "model.n_layers=4", "trainer.global_batch_size=6"],
            "micro-batches",
        ),
        (["strategy=tp", "strategy.compile=true"], "strategy.compile"),
        (["strategy.compile=true", "strategy.activation_checkpoint=true"], "strategy.compile"),
        (
            [
                "strategy=pp",
                "strategy.schedule=interleaved_zb",
                "model.n_layers=4",
                "strategy.activation_checkpoint=true",
            ],
            "strategy.activation_checkpoint",
        ),
        (
            ["strategy=pp", "strategy.schedule=interleaved_zb", "model.n_layers=4", "strategy.compile=true"],
            "strategy.compile",
        ),
        (["strategy=ddp", "strategy.dp_shard=2"], "strategy.zero"),
        (["strategy=zero3", "strategy.dp_replicate=-1"], "strategy.dp_shard"),
        (["strategy=3d"], "cluster.num_workers"),
        (["model.n_heads=3"], "model.dim"),
        (["optim.name=lion"], "optim.name"),
        (["checkpoint.keep=0"], "checkpoint.keep"),
        (["logger.wandb.mode=sometimes"], "logger.wandb.mode"),
        (["cluster.max_failures=-2"], "cluster.max_failures"),
        (["cluster.min_workers=3", "cluster.num_workers=2"], "cluster.min_workers"),
        (["cluster.hang_timeout_s=0"], "cluster.hang_timeout_s"),
        (["cluster.stop_grace_s=-1"], "cluster.stop_grace_s"),
        (["cluster.setup_timeout_s=0"], "cluster.setup_timeout_s"),
        (["cluster.node_check_s=0"], "cluster.node_check_s"),
        (["cluster.restart_backoff_s=-1"], "cluster.restart_backoff_s"),
        (["strategy=ps", "ps.mode=gossip"], "ps.mode"),
        (["strategy=ps", "ps.num_servers=0"], "ps.num_servers"),
        (["strategy=ps", "ps=easgd", "ps.tau=0"], "ps.tau"),
        (["strategy=ps", "ps=easgd", "ps.alpha=1.0"], "ps.alpha"),
        (["strategy=ps", "ps=easgd", "ps.alpha=0"], "ps.alpha"),
        (["strategy=ps", "ps.backup_workers=2", "cluster.num_workers=2"], "ps.backup_workers"),
        (["strategy=ps", "ps=async", "ps.backup_workers=1"], "ps.backup_workers"),
        (["strategy=ps", "ps.max_staleness=2"], "ps.max_staleness"),
        (["strategy=ps", "ps=async", "ps.max_staleness=-1"], "ps.max_staleness"),
        (["strategy=ps", "strategy.tp=2", "cluster.num_workers=2"], "data-parallel only"),
        (["strategy=ps", "cluster.min_workers=1"], "cluster.min_workers"),
        (["fault.straggler=2"], "fault.straggler"),
        (["fault.straggler_slowdown=0.5"], "fault.straggler_slowdown"),
        (["fault.kill_rank=2"], "fault.kill_rank"),
        (["fault.kill_at_step=0"], "fault.kill_at_step"),
        (["strategy=ps", "fault.kill_at_step=1"], "fault.kill_at_step"),
        (["fault.kill_at_step=1", "fault.kill_mid_upload=true"], "fault.kill_mid_upload"),
        (["fault.fail_in_update=true"], "set fault.kill_at_step too"),
        (["fault.slow_return_s=-1"], "fault.slow_return_s"),
        (["fault.kill_at_step=1", "fault.kill_after_backward=true", "fault.fail_in_update=true"], "set one of them"),
        (["cluster.spares=-1"], "cluster.spares"),
        (["cluster.local_cpus=-1"], "cluster.local_cpus"),
        (["+cluster.env_vars.MASTER_ADDR=10.0.0.1"], "cluster.env_vars.MASTER_ADDR"),
        # 2-D, 2.5-D, 3-D tensor parallelism: the grid's shape, and the sizes it splits (the tests' model:
        # dim 32, 2 heads, ffn 64, vocab 256, micro-batch 2).
        (["strategy.tp_mode=4d"], "strategy.tp_mode"),
        (["strategy=tp2d", "strategy.tp=8", "cluster.num_workers=8"], "not a square"),
        (["strategy=tp2p5d", "strategy.tp=12", "cluster.num_workers=12"], "tp_depth × a square"),
        (["strategy=tp3d", "strategy.tp=4", "cluster.num_workers=4"], "not a cube"),
        (["strategy=tp2d", "strategy.tp_depth=2", "cluster.num_workers=4"], "strategy.tp_depth"),
        (["strategy=tp2d", "cluster.num_workers=4", "model.vocab_size=257"], "model.vocab_size"),
        (["strategy=tp3d", "cluster.num_workers=8", "trainer.micro_batch_size=4", "model.ffn_dim=66"], "model.ffn_dim"),
        (["strategy=tp2d", "cluster.num_workers=4", "model.n_heads=1", "model.dim=16"], "model.n_heads"),
        (["strategy=tp3d", "cluster.num_workers=8"], "trainer.micro_batch_size"),
        (["strategy=tp2p5d", "cluster.num_workers=8"], "trainer.micro_batch_size"),
        (
            [
                "strategy=tp2d",
                "strategy.pp=2",
                "strategy.schedule=interleaved_zb",
                "model.n_layers=4",
                "cluster.num_workers=8",
            ],
            "strategy.schedule=interleaved_zb",
        ),
        (["strategy=tp2d", "strategy.zero=2", "strategy.dp_shard=2", "cluster.num_workers=8"], "strategy.zero=2"),
        (["strategy=tp2d", "strategy.compile=true", "cluster.num_workers=4"], "strategy.compile"),
    ],
)
def test_validate_names_the_key(tmp_path: Path, overrides: list[str], key: str):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as err:
        validate(make_config(tmp_path, "run.name=bad", *overrides))
    assert "\n" not in str(err.value)


# Each refusal of validation that no other test made fire (tests/checks.txt), with its own words.
REFUSALS = {
    "head dim odd (rotary)": (["model.dim=30", "model.n_heads=2"], "model.dim / model.n_heads = 15 must be even"),
    "head_dim odd (rotary)": (["model.head_dim=15"], "model.head_dim=15 must be even and positive (rotary)"),
    "qk norm in gpt2": (
        ["model=gpt2_nano", "model.qk_norm=true"],
        "model.head_dim=None model.qk_norm=True: the family distrain.model.gpt2.GPT2 has neither",
    ),
    "qk norm on the grid": (
        ["model.qk_norm=true", "strategy=tp2d", "cluster.num_workers=4"],
        "tie_embeddings=False, qk_norm=True) has no plan for it; use strategy.tp_mode=1d",
    ),
    "kv heads": (["model.n_heads=4", "model.n_kv_heads=3"], "model.n_kv_heads=3 must divide model.n_heads=4"),
    "vocab": (["model.vocab_size=100"], "model.vocab_size=100: byte tokens need at least 256"),
    "positions over tp": (
        ["model=gpt2_nano", "model.n_positions=33", "strategy=tp", "cluster.num_workers=2"],
        "strategy.tp=2 does not divide model.n_positions=33",
    ),
    "cpus per worker": (["cluster.cpus_per_worker=0"], "cluster.cpus_per_worker=0.0: must be positive"),
    "threads per worker": (["cluster.threads_per_worker=0"], "cluster.threads_per_worker=0: must be ≥ 1"),
    "max steps": (["trainer.max_steps=0"], "trainer.max_steps=0: must be ≥ 1"),
    "seq len": (["trainer.seq_len=1"], "trainer.seq_len=1: must be ≥ 2"),
    "log interval": (["trainer.log_interval=0"], "trainer.log_interval=0: must be ≥ 1"),
    "eval batches": (["trainer.eval_batches=0"], "trainer.eval_batches=0: must be ≥ 1"),
    "loss chunk": (["trainer.loss_chunk=-1"], "trainer.loss_chunk=-1: must be ≥ 0"),
    "precision": (["trainer.precision=fp8"], "trainer.precision='fp8': choose one of"),
    "lr": (["optim.lr=-1"], "optim.lr=-1.0: must be positive"),
    "warmup": (["optim.warmup_steps=-1"], "optim.warmup_steps=-1: must be ≥ 0"),
    "decay": (["optim.decay_steps=1"], "optim.decay_steps=1 must exceed optim.warmup_steps=2"),
    "grad clip": (["optim.grad_clip=-1"], "optim.grad_clip=-1.0: must be ≥ 0"),
    "muon ns steps": (["optim=muon", "optim.ns_steps=0"], "optim.ns_steps=0: must be ≥ 1"),
    "muon params": (["optim=muon", "optim.muon_params=all"], "optim.muon_params='all': choose blocks or matrices"),
    "muon on ps": (["optim=muon", "strategy=ps"], "optim=muon needs whole matrices, and the parameter server's"),
    "muon on the grid": (
        ["optim=muon", "strategy=tp2d", "cluster.num_workers=4"],
        "optim=muon needs whole matrices, and strategy.tp_mode=2d splits them",
    ),
    "checkpoint interval": (["checkpoint.interval=-1"], "checkpoint.interval=-1: must be ≥ 0"),
    "run name": (["run.name=a/b"], "run.name='a/b': must be a plain name"),
    "val fraction": (["data.val_fraction=0"], "data.val_fraction=0.0: must be in (0, 1)"),
    "dp shard": (["strategy.dp_shard=0"], "strategy.dp_shard=0: must be at least 1, or -1 for the workers left"),
    "tp": (["strategy.tp=0"], "strategy.tp=0: must be at least 1"),
    "micro batch": (["trainer.micro_batch_size=0"], "trainer.micro_batch_size=0: must be ≥ 1"),
    "zero without shards": (
        ["strategy.zero=3", "strategy.dp_shard=1", "strategy.dp_replicate=2", "cluster.num_workers=2"],
        "strategy.zero=3 shards over strategy.dp_shard, which is 1 (dp_replicate=2)",
    ),
    "tp depth": (["strategy=tp2p5d", "cluster.num_workers=8", "strategy.tp_depth=0"], "strategy.tp_depth=0: must be"),
    "tp depth divides": (
        ["strategy=tp2p5d", "cluster.num_workers=8", "strategy.tp_depth=3"],
        "strategy.tp=8 is not divisible by strategy.tp_depth=3",
    ),
    "grid offload": (
        ["strategy=tp2d", "cluster.num_workers=4", "strategy.offload=cpu"],
        "strategy.tp_mode=2d (tp=4) does not support strategy.offload=cpu; set it to none",
    ),
    "tokenizer": (["tokenizer.name=foo"], "tokenizer.name='foo': choose bytes or bpe"),
    "model target": (["model._target_=nodots"], "model._target_=nodots: not a dotted path pkg.module.name"),
}


@pytest.mark.parametrize(("overrides", "says"), list(REFUSALS.values()), ids=list(REFUSALS))
def test_each_rule_refuses_in_its_own_words(tmp_path: Path, overrides: list[str], says: str):
    with pytest.raises(ConfigError) as err:
        validate(make_config(tmp_path, *overrides))
    assert says in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize(
    ("source", "says"),
    [
        (
            "import distrain_no_such_dependency\n",
            "importing broken failed: No module named 'distrain_no_such_dependency'",
        ),
        ("raise RuntimeError('boom')\n", "importing broken failed: RuntimeError: boom"),
    ],
    ids=["its dependency missing", "raises"],
)
def test_a_model_module_that_fails_to_import_is_named_in_one_line(tmp_path: Path, monkeypatch, source: str, says: str):
    """The user's module is found but fails itself: the error is its own, not 'no module named broken'."""
    (tmp_path / "broken.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "broken", raising=False)
    with pytest.raises(ConfigError) as err:
        validate(make_config(tmp_path, "model._target_=broken.Model"))
    assert says in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_corpus_too_small_to_validate_on_is_refused(tmp_path: Path):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("x" * 200)
    with pytest.raises(ConfigError, match=r"leaves \d+ bytes for validation") as err:
        validate(make_config(tmp_path, f"data.path={corpus}"))
    assert "\n" not in str(err.value)


NOT_FINITE = [
    "optim.lr=inf",
    "optim.lr=nan",
    "model.init_std=-inf",
    "cluster.node_check_s=nan",
    "cluster.collective_timeout_s=inf",  # a timedelta in every rank: OverflowError, retried to the failure budget
    "cluster.setup_timeout_s=inf",
    "cluster.connect_timeout_s=inf",
]


@pytest.mark.parametrize("override", NOT_FINITE)
def test_a_number_that_is_not_finite_is_refused(tmp_path: Path, override: str):
    """inf trained to NaN at the first steps (and nan was called "not positive"); an infinite timeout failed in
    every rank: a large one means no limit."""
    with pytest.raises(ConfigError) as err:
        validate(make_config(tmp_path, override))
    assert str(err.value) == f"{override}: must be a finite number"


@pytest.mark.parametrize(
    ("policy", "needle"),
    [
        ("cluster.policy=defualt", "cluster.policy=defualt: no such failure policy; did you mean default?"),
        (
            "cluster.policy._target_=user_policy.fail_fast.FailFsat",
            "user_policy.fail_fast has no attribute FailFsat; did you mean user_policy.fail_fast.FailFast?",
        ),
        ("cluster.policy._target_=distrain.cluster.policy.FailurePolicy", "not a subclass of distrain.cluster.policy."),
    ],
)
def test_a_failure_policy_that_is_none_fails_before_anything_starts(tmp_path, monkeypatch, policy, needle):
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    with pytest.raises(ConfigError) as err:
        train(make_config(tmp_path, "run.name=bad", policy))
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "bad").exists()  # no run directory, no cluster


def test_defaults_are_valid_and_validation_changes_nothing(tmp_path: Path):
    cfg = make_config(tmp_path, "run.name=ok", "strategy=3d", "cluster.num_workers=8")
    before = repr(cfg)
    assert validate(cfg) == layout_of(pp=2, dp_replicate=1, dp_shard=2, tp=2, micro_batches=2)
    assert repr(cfg) == before  # the -1 dims and the open stages_per_rank stay as the user wrote them


@pytest.mark.parametrize(
    ("overrides", "sizes"),
    [
        # 8 sequences of micro-batch 2: 4 and 2 workers divide them, 3 does not.
        (["cluster.num_workers=4", "cluster.min_workers=2"], [2]),
        (["cluster.num_workers=4"], []),  # no min_workers: no shrinking
        # tp=2: a run loses whole tensor-parallel pairs, so 3 workers is no layout.
        (["strategy=tp", "cluster.num_workers=4", "cluster.min_workers=2"], [2]),
    ],
)
def test_a_run_shrinks_only_to_valid_layouts_with_the_same_global_batch(tmp_path, overrides, sizes):
    cfg = make_config(tmp_path, "run.name=ok", *overrides)
    layouts = smaller(validate(cfg), cfg)
    assert list(layouts) == sizes
    for n, layout in layouts.items():
        assert layout.world_size == n and layout.micro_batches * layout.dp * cfg.trainer.micro_batch_size == 8


def test_min_workers_that_allow_no_smaller_layout_are_refused(tmp_path: Path):
    cfg = make_config(tmp_path, "run.name=bad", "strategy=tp", "strategy.dp_replicate=1", "cluster.min_workers=1")
    with pytest.raises(ConfigError, match=r"cluster\.min_workers=1 allows no layout smaller than 2 workers"):
        validate(cfg)


@pytest.mark.parametrize(
    ("overrides", "sizes"),
    [
        (["strategy=ddp", "cluster.num_workers=4"], (1, 4, 1, 1)),
        (["strategy=zero3", "cluster.num_workers=4"], (1, 1, 4, 1)),
        (["strategy=hsdp", "cluster.num_workers=8", "trainer.global_batch_size=16"], (1, 4, 2, 1)),
        (["strategy=tp", "cluster.num_workers=4"], (1, 2, 1, 2)),
        (["strategy=3d", "cluster.num_workers=8"], (2, 1, 2, 2)),
    ],
)
def test_the_layout_fills_the_open_mesh_dims(tmp_path: Path, overrides: list[str], sizes: tuple[int, ...]):
    layout = validate(make_config(tmp_path, "run.name=ok", *overrides))
    assert (layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp) == sizes


def run_cli(tmp_path: Path, *overrides: str, ray_address: str | None = None) -> subprocess.CompletedProcess:
    """The entrypoint on an embedded cluster of 2 CPUs and no GPU, whatever this machine has (RAY_ADDRESS unset,
    or `ray_address`)."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    env.update({"RAY_ADDRESS": ray_address} if ray_address else {})
    cluster = ["cluster.local_cpus=2", "cluster.local_gpus=0"]
    return subprocess.run(
        [
            sys.executable,
            str(REPO / "jobs" / "train.py"),
            f"run.storage={tmp_path}",
            "run.name=bad",
            *cluster,
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["model=gpt5"], "unknown model 'gpt5'"),
        (["strategy=magic"], "unknown strategy 'magic'"),
        (["strategy=pp", "strategy.schedule=zigzag"], "strategy.schedule='zigzag'"),
        (["strategy=3d", "cluster.num_workers=6"], "cluster.num_workers=6 is not divisible"),
        (["strategy=tp3d", "strategy.tp=4", "cluster.num_workers=4"], "strategy.tp=4 is not a cube"),
        (["cluster.num_workers=0"], "cluster.num_workers=0"),
        (["trainer.global_batch_size=30"], "trainer.global_batch_size=30"),
        (["data.path=/nonexistent/corpus"], "data.path='/nonexistent/corpus'"),
        # The embedded cluster has 2 CPUs (run_cli says so): 3 workers × 1 CPU can never be placed.
        (
            ["cluster.num_workers=3", "cluster.cpus_per_worker=1", "trainer.global_batch_size=24"],
            "cluster.num_workers=3 needs 3 CPU",
        ),
        # An embedded cluster has no autoscaler: GPUs it lacks are refused at once, not waited for.
        (["cluster.use_gpu=true"], "needs 2 GPU (GPUs per worker=1 each) but the cluster has 0"),
    ],
)
def test_cli_bad_input_fails_early_with_one_line(tmp_path: Path, overrides: list[str], needle: str):
    result = run_cli(tmp_path, *overrides)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("distrain: error:")]
    assert len(errors) == 1 and needle in errors[0], result.stderr
    said = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("distrain:")]
    assert said == errors, "a refused run says one line, not what it would have trained on first"
    assert "Traceback" not in result.stderr
    run_dir = tmp_path / "bad"
    assert not (run_dir / "placement.json").exists()  # no worker was ever placed
    assert not (run_dir / "checkpoints").exists()


def test_cfg_job_prints_the_composed_config(tmp_path: Path):
    result = run_cli(tmp_path, "model=gpt2_124m", "checkpoint.async=false", "--cfg", "job")
    assert result.returncode == 0, result.stderr
    assert "dim: 768" in result.stdout and "name: ddp" in result.stdout
    assert "async_save: false" in result.stdout  # `async` is a keyword: the command line's name for the field


def test_a_path_from_home_is_read_as_the_shell_would(tmp_path: Path, monkeypatch):
    """`data.path=~/corpus` as printed in the docs: the shell leaves it alone and Hydra's grammar has no `~`;
    the entrypoint (through --cfg job) and compose (prepare_data's way) both read it as the home directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert make_config(tmp_path, "data.path=~/corpus").data.path == f"{tmp_path}/corpus"
    result = run_cli(tmp_path, "data.path=~/corpus", "--cfg", "job")
    assert result.returncode == 0 and f"path: {tmp_path}/corpus" in result.stdout, result.stderr


def test_checkpoints_are_written_in_the_background_unless_asked_not_to(tmp_path: Path):
    assert make_config(tmp_path).checkpoint.async_save
    assert not make_config(tmp_path, "checkpoint.async=false").checkpoint.async_save
