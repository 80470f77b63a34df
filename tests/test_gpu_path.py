"""The GPU path, tested where a CPU can test it: a rank given a GPU that its torch cannot use fails in one
line; a process group is never silently reused; after a failure a group aborts the collectives blocked
calls wait in and keeps a process only if its health check passes; collectives outside training steps
wait setup_timeout_s; cluster.use_gpu=null says what it chose, and cluster.use_gpu=true waits for GPUs.

What only a GPU shows (an NCCL survivor of a dead peer freed by the abort, a real sticky CUDA error
failing the health check) is not here: see process_group.abort and check_device.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch
import torch.multiprocessing as mp
from conftest import free_port, make_config, rank_env

from distrain.channel import Channel
from distrain.config import ConfigError
from distrain.parallel import process_group
from distrain.train.job import RankJob

# Ray is imported by the tests that use it: the ranks spawned below import this module, and start faster without.


# -- a GPU rank on a torch that cannot use CUDA --------------------------------------------------------


def join_as_gpu_rank(index: int, port: int, out: str) -> None:
    """As a Ray worker given GPU 0 would (CUDA_VISIBLE_DEVICES=0), on this CPU-only torch."""
    import torch.distributed as dist

    rank_env(0, 1, port, CUDA_VISIBLE_DEVICES="0")
    try:
        process_group.init_from_env(timeout_s=10, gpu=True)
        result = {"error": None}
    except process_group.GpuUnavailableError as e:
        result = {"error": str(e)}
    result["initialized"] = dist.is_initialized()
    result["torchrun"] = str(process_group.init_from_env(timeout_s=10))  # given nothing: what torch sees
    process_group.destroy()
    Path(out).write_text(json.dumps(result))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that cannot use CUDA")
@pytest.mark.timeout(60)
def test_a_gpu_rank_whose_torch_cannot_use_cuda_fails_in_one_line_naming_the_node(tmp_path: Path):
    out = tmp_path / "result.json"
    mp.spawn(join_as_gpu_rank, args=(free_port(), str(out)), nprocs=1)
    result = json.loads(out.read_text())
    error = result["error"]
    assert error is not None, "a GPU rank trained on the CPU"
    assert "\n" not in error and f"node {socket.gethostname()}:" in error
    build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
    assert build in error and "CUDA_VISIBLE_DEVICES='0'" in error
    assert not result["initialized"]  # no gloo group formed in its place
    assert result["torchrun"] == "cpu"  # not told it has a GPU (plain torchrun): the CPU, as before


GIVEN_GPUS = ["ddp", "ps"]


@pytest.fixture(scope="module")
def runs_given_gpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, Path]]:
    """The runs of the test below, one per strategy, started at once: each is mostly the start of one process
    after another (Ray's, the workers', torch's import), so side by side they take about the time of one.
    strategy → its exit status, its stderr, and its storage."""
    from conftest import REPO, TIMEOUT_SCALE, TINY

    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    gpus = ["cluster.local_cpus=2", "cluster.local_gpus=2", "cluster.use_gpu=true", "cluster.reuse_workers=false"]
    started = {}
    for strategy in GIVEN_GPUS:
        storage = tmp_path_factory.mktemp(f"given-gpus-{strategy}")
        args = [*TINY, *gpus, f"strategy={strategy}", f"run.storage={storage}", "run.name=gpu"]
        with open(storage / "stdout", "w") as out, open(storage / "stderr", "w") as err:
            cmd = [sys.executable, str(REPO / "jobs" / "train.py"), *args]
            started[strategy] = (subprocess.Popen(cmd, stdout=out, stderr=err, cwd=storage, env=env), storage)
    deadline, ended = time.monotonic() + 180 * TIMEOUT_SCALE, {}  # each run's 180 s, stretched as a test's limit
    try:
        for strategy, (proc, storage) in started.items():
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            ended[strategy] = (rc, (storage / "stderr").read_text(), storage)
    finally:
        for proc, _ in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return ended


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that cannot use CUDA")
@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", GIVEN_GPUS)
def test_a_run_given_gpus_its_torch_cannot_use_ends_at_once(runs_given_gpus, strategy: str):
    """The whole path: Ray gives each worker a GPU (an embedded cluster that declares 2), the engine tells
    the ranks, and the run ends on the first attempt (the error says retrying cannot help). A parameter-server
    worker, which has no process group, chooses its device through the same `device_for`: before, it trained
    on the CPU in silence while its GPU sat idle."""
    returncode, stderr, storage = runs_given_gpus[strategy]
    assert returncode == 1, stderr[-3000:]
    error = next(line for line in stderr.splitlines() if line.startswith("distrain: error:"))
    assert "GpuUnavailableError: node " in error and "cluster.use_gpu=false" in error, stderr[-3000:]
    attempts = json.loads((storage / "gpu" / "summary.json").read_text())["attempts"]
    assert len(attempts) == 1, [a["cause"] for a in attempts]


# -- a process group is never silently reused ------------------------------------------------------------


def store_port() -> int:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store.port


def init_twice(index: int, ports: list[int], out: str) -> None:
    """Two attempts in one process, the first never ended; then a group someone else formed (Ray Train).
    On gloo (gpu=False) on any machine: on a GPU one, NCCL's abort would free the collective."""
    import torch.distributed as dist

    rank_env(0, 1, ports[0])
    process_group.init_from_env(timeout_s=10, gpu=False)
    first = dist.group.WORLD
    rank_env(0, 1, ports[1])
    process_group.init_from_env(timeout_s=10, gpu=False)
    total = torch.ones(1)
    dist.all_reduce(total)
    result = {"fresh": dist.group.WORLD is not first, "port": store_port(), "sum": total.item()}
    result["abort_frees_a_gloo_collective"] = process_group.abort()
    result["after_abort"] = dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[2]}", rank=0, world_size=1)
    theirs = dist.group.WORLD
    process_group.init_from_env(timeout_s=10, gpu=False)
    result["adopted"] = dist.group.WORLD is theirs
    process_group.destroy()
    Path(out).write_text(json.dumps(result))


@pytest.mark.timeout(60)
def test_init_replaces_a_group_an_earlier_attempt_left(tmp_path: Path):
    out, ports = tmp_path / "result.json", [free_port() for _ in range(3)]
    mp.spawn(init_twice, args=(ports, str(out)), nprocs=1)
    result = json.loads(out.read_text())
    assert result["fresh"] and result["port"] == ports[1] and result["sum"] == 1.0
    assert result["abort_frees_a_gloo_collective"] is False and result["after_abort"] is False
    assert result["adopted"]


# -- after a failure: abort blocked calls, keep only healthy processes --------------------------------


def wait_unless_aborted(channel) -> None:
    """Ranks 0 and 1 raise; 2 and 3 wait, as survivors of a dead peer wait in a collective."""
    if os.environ["RANK"] in ("0", "1"):
        raise ValueError("the rank's own error")
    while "TEST_ABORTED" not in os.environ:
        time.sleep(0.01)
    raise RuntimeError("its collective was aborted")


def abort_on_rank_two() -> bool:
    """Frees rank 2's call, as aborting NCCL frees a survivor; rank 3's waits on, as gloo's would."""
    if os.environ["RANK"] != "2":
        return False
    os.environ["TEST_ABORTED"] = "1"
    return True


def sticky_error_on_rank_one() -> bool:
    """Rank 1's device fails, as after an illegal address; the others' work."""
    if os.environ["RANK"] == "1":
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    return True


def test_the_device_check_runs_work_on_the_device(monkeypatch):
    """A usable device passes (the CPU, or a GPU where there is one). Where CUDA is said to be but no kernel
    can run (here: torch built without CUDA), the check raises, as on a GPU with a sticky error: it does
    run work on the device rather than trust that it is there."""
    assert process_group.check_device() is True
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
            process_group.check_device()


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.timeout(120)
def test_after_a_failure_blocked_calls_are_aborted_and_only_healthy_processes_kept():
    import ray
    import ray.cloudpickle
    from ray.exceptions import RayActorError

    from distrain.cluster.placement import GroupSpec
    from distrain.cluster.worker_group import WorkerGroup

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    spec = GroupSpec(num_workers=4, cpus_per_worker=0.25, gpus_per_worker=0, threads_per_worker=1)
    with WorkerGroup(spec) as group:
        group.start()
        group.recover_with(sticky_error_on_rank_one, abort_on_rank_two)
        group.launch(wait_unless_aborted)
        raised: set[int] = set()
        deadline = time.monotonic() + 60
        while raised != {0, 1} and time.monotonic() < deadline:
            raised |= {rank for rank, _, error in group.poll(1.0) if error is not None}
        assert raised == {0, 1}
        started = time.monotonic()
        group.release_unhealthy(timeout_s=5.0)
        assert time.monotonic() - started < 5.0  # rank 3, whose abort frees nothing, was not waited for
        assert group.returned == {0, 2}
        alive = []
        for worker in group.workers:
            try:
                alive.append(ray.get(worker.node_info.remote(), timeout=30) is not None)
            except RayActorError:
                alive.append(False)
        assert alive == [True, False, True, False]  # 1 failed its check, 3 never returned: both killed


# -- collectives outside training steps ---------------------------------------------------------------


SLOW_WRITE_S = 5.0


def train_rank(rank: int, port: int, job: RankJob, out: str) -> None:
    """One rank of a 2-rank run whose rank 1 takes SLOW_WRITE_S longer to write its first checkpoint."""
    rank_env(rank, 2, port, CUDA_VISIBLE_DEVICES="")
    from distrain.storage import saver
    from distrain.train.rank import run_rank

    if rank == 1:
        save = saver.Saver.save

        def slow_save(*args, **kwargs):
            saver.Saver.save = save
            time.sleep(SLOW_WRITE_S)
            return save(*args, **kwargs)

        saver.Saver.save = slow_save
    Path(out, f"rank{rank}.json").write_text(json.dumps(run_rank(job, Channel())))


@pytest.mark.timeout(180)
def test_a_slow_checkpoint_write_on_one_rank_does_not_time_out_the_other(tmp_path: Path):
    from distrain.driver.validation import validate
    from distrain.storage import checkpoint

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(Path(__file__).read_text() * 20)
    cfg = make_config(
        tmp_path,
        "run.name=slow",
        f"data.path={corpus}",
        "cluster.num_workers=2",
        "trainer.max_steps=1",
        "checkpoint.interval=1",
        "cluster.collective_timeout_s=3",  # a step's collectives: shorter than the slow write
        "cluster.setup_timeout_s=60",  # what the supervisor allows a checkpoint: the others wait that long
    )
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True)
    job = RankJob(cfg, validate(cfg), str(run_dir), time.time(), use_gpu=False)
    mp.spawn(train_rank, args=(free_port(), job, str(tmp_path)), nprocs=2)
    assert json.loads((tmp_path / "rank0.json").read_text())["final_step"] == 1
    assert checkpoint.read_meta(checkpoint.latest(run_dir / "checkpoints"))["step"] == 1


def test_the_collective_timeout_must_be_positive(tmp_path: Path):
    from distrain.driver.validation import validate

    with pytest.raises(ConfigError, match=r"^cluster\.collective_timeout_s=0\.0: must be positive$"):
        validate(make_config(tmp_path, "cluster.collective_timeout_s=0"))


# -- choosing GPUs -------------------------------------------------------------------------------------


@pytest.mark.usefixtures("ray_cluster")
def test_auto_says_it_chose_cpus_on_a_cluster_without_gpus(tmp_path: Path):
    from distrain.driver.validation import validate
    from distrain.driver.workers import group_spec

    cfg = make_config(tmp_path, "cluster.use_gpu=null")
    said: list[str] = []
    assert group_spec(cfg, validate(cfg), said.append).gpus_per_worker == 0
    assert len(said) == 1 and "no GPU" in said[0] and "CPUs" in said[0] and "cluster.use_gpu=true" in said[0]


@pytest.mark.usefixtures("ray_cluster")
def test_auto_says_its_choice_once_for_every_run_of_a_sweep(tmp_path: Path, monkeypatch):
    """Each point of a sweep checks its run as it starts: the same devices on the same cluster, said at the first."""
    from distrain.driver import console
    from distrain.driver.validation import validate
    from distrain.driver.workers import placeable_spec

    monkeypatch.setattr(console, "SAID", set())  # what this process said before (other tests) aside
    said: list[str] = []
    for lr in ("0.001", "0.003"):
        cfg = make_config(tmp_path, "cluster.use_gpu=null", f"optim.lr={lr}")
        placeable_spec(cfg, validate(cfg), said.append)
    assert len(said) == 1 and said[0].startswith("cluster.use_gpu=null: the cluster has no GPU now"), said


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.timeout(60)
def test_use_gpu_true_waits_for_gpus_then_fails_in_one_line(tmp_path: Path):
    from ray.util.placement_group import placement_group_table

    from distrain.cluster.runtime import CapacityError
    from distrain.driver.validation import validate
    from distrain.driver.workers import placeable_spec

    # Attached (an embedded cluster has no autoscaler, so it is refused at once: test_config's bad input)
    address = ray.get_runtime_context().gcs_address
    cfg = make_config(tmp_path, "cluster.use_gpu=true", "cluster.placement_timeout_s=1", f"cluster.address={address}")
    said: list[str] = []
    started = time.monotonic()
    with pytest.raises(CapacityError) as err:
        placeable_spec(cfg, validate(cfg), said.append)
    assert time.monotonic() - started >= 1.0
    said = [line for line in said if not line.startswith("attaching")]
    assert len(said) == 1 and "waiting up to 1 s" in said[0] and "2 GPUs" in said[0]
    message = str(err.value)
    assert "\n" not in message and "cluster.placement_timeout_s=1" in message and "cluster.use_gpu=false" in message
    assert not [g for g in placement_group_table().values() if g["state"] == "PENDING"]  # the trial was removed
