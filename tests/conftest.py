"""One embedded Ray cluster per test session, on loopback and of a stated size; tiny models; configs
composed as `jobs/train.py` composes them."""

from __future__ import annotations

import ast
import json
import os
import random
import re
import signal
import subprocess
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray is imported: bind 127.0.0.1 only
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # and send nothing anywhere else
os.environ.pop("RAY_ADDRESS", None)
# Ray starts its workers at nice 15: beside the suite's other stream (nice 0, tests/conftest.py's scheduler) they got
# a few percent of a core, and a fresh worker's import of torch took 20 s or more (limits of 8 s ran out). Fair
# shares for every process of the suite: its clusters', its beds' and the jobs it submits.
os.environ["RAY_worker_niceness"] = "0"
os.environ.pop("WANDB_API_KEY", None)

from distrain.cluster.attempt import Mark  # noqa: E402
from distrain.cluster.places import RankPlace  # noqa: E402
from distrain.config import TrainConfig  # noqa: E402
from distrain.driver.cli import CONF_DIR, compose  # noqa: E402, F401  (CONF_DIR: for test modules)
from distrain.ports import free_port  # noqa: E402  (also for test modules)
from distrain.storage import checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

# A model and batch small enough that a 4-worker run of 20 steps takes seconds on 2 cores.
TINY = [
    "model.dim=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.ffn_dim=64",
    "trainer.seq_len=32",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=2",
    "trainer.eval_interval=0",
    "trainer.eval_batches=1",
    "optim.warmup_steps=2",
    "checkpoint.interval=0",
    "logger.wandb.mode=disabled",
    "cluster.use_gpu=false",  # the same CPU/gloo/fp32 training on a GPU machine
    "trainer.precision=fp32",
    # Runs of the same shape reuse their warm workers (a worker's start, torch's import included, takes
    # seconds on 2 cores); the fresh start is what the main-job, CLI and job-submit tests exercise.
    "cluster.reuse_workers=true",
]


# Damage done to a committed checkpoint after its commit (issue 32), each with what the line that skips it
# says: 4 KiB overwritten at the start of its largest DCP shard or in the middle (tensor bytes), size
# unchanged; meta.json garbled and the rank file replaced by random bytes, at their sizes; the shard truncated.
DAMAGES = {
    "shard_head": "no longer matches the checksum",
    "tensor_bytes": "no longer matches the checksum",
    "meta_garbled": "meta.json no longer matches the checksum",
    "rank_file_random": "rank_00000.pt no longer matches the checksum",
    "shard_truncated": "the commit recorded",
}


def damage(path: Path, kind: str) -> None:
    """Damage the checkpoint directory `path` as DAMAGES[kind] says; tensor bytes: 4 KiB of 0xFF (NaNs in
    float32) in the middle of the largest tensor DCP stored, where no file format check can notice."""
    from torch.distributed.checkpoint import FileSystemReader

    shard = max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)
    if kind == "shard_truncated":
        os.truncate(shard, shard.stat().st_size // 2)
        return
    if kind == "tensor_bytes":
        item = max(FileSystemReader(path).read_metadata().storage_data.values(), key=lambda info: info.length)
        target, at, data = path / item.relative_path, item.offset + item.length // 2 - 2048, b"\xff" * 4096
    elif kind == "shard_head":
        target, at, data = shard, 0, random.Random(kind).randbytes(4096)
    else:
        target = path / ("meta.json" if kind == "meta_garbled" else "rank_00000.pt")
        size = target.stat().st_size
        target, at, data = target, 0, b"#" * size if kind == "meta_garbled" else random.Random(kind).randbytes(size)
    with open(target, "r+b") as f:
        f.seek(at)
        f.write(data)


def rank_env(rank: int, world: int, port: int, **extra: str) -> None:
    """The environment of a gloo rank on loopback as torchrun sets it, one torch thread; `extra` beside."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.update(MASTER_PORT=str(port), OMP_NUM_THREADS="1", **extra)


# Gloo ranks that run without Ray (parallel-layer, checkpoint and memory tests) are forked from a fork server: one
# process that imported torch, its distributed packages, distrain's layers and this file once for the session.
# Spawning a rank afresh costs an interpreter and those imports, seconds each on 2 cores. A rank sets its own
# environment first (rank_env), as a spawned one does; it sees the parent's environment as it was when the server
# started, the first time a test spawned ranks.
RANK_PRELOAD = [
    "torch",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "conftest",
    "distrain.parallel.parallelize",
    "distrain.train.learner",
    "distrain.train.state",
    "distrain.storage.saver",
]


def spawn_ranks(fn: Callable, args: tuple, nprocs: int) -> None:
    """torch.multiprocessing.spawn(fn, args, nprocs), its ranks forked from the session's fork server."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(RANK_PRELOAD)  # read when the server starts, once
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def documented(page: str, section: str) -> list[str]:
    """The commands of the first bash block in docs/<page>'s `## <section>`, as printed (comments and all)."""
    text = (REPO / "docs" / page).read_text().split(f"\n## {section}\n", 1)[1]
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def bash(command: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`command` in bash from the repository root, as a user would type it there."""
    return subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def make_config(storage: Path, *overrides: str) -> TrainConfig:
    """The config `python jobs/train.py TINY... overrides...` would train."""
    return compose([*TINY, f"run.storage={storage}", *overrides])


# The session's cluster: 4 logical CPUs (8 workers of 0.25 CPU, or 4 and 4 parameter servers), no
# GPU, whatever the machine has; the tests that need another shape start a cluster of their own.
CLUSTER_CPUS = 4


# A fixture's setup (a cluster, a module's reference runs, a spawn of ranks) is bounded on its own, not inside the
# first test that asks for it: pytest-timeout's limits cover a test's own call only (`timeout_func_only`).
# DISTRAIN_TIMEOUT_SCALE stretches every limit for a slower run of the suite (`make coverage` measures under 2).
TIMEOUT_SCALE = float(os.environ.get("DISTRAIN_TIMEOUT_SCALE", "1"))
FIXTURE_TIMEOUT_S = 900 * TIMEOUT_SCALE


def pytest_collection_modifyitems(config, items):
    if TIMEOUT_SCALE != 1:
        for item in items:
            marker = item.get_closest_marker("timeout")
            limit = marker.args[0] if marker and marker.args else config.getini("timeout")
            item.add_marker(pytest.mark.timeout(float(limit) * TIMEOUT_SCALE), append=False)


def pytest_xdist_make_scheduler(config, log):  # noqa: ANN001, ANN201
    """`make test` runs the suite in two streams (pytest-xdist, `-n 2`): every test that uses the session's Ray
    cluster in one, in file order (so one module's warm workers serve the next, and one cluster serves them all),
    and each module's other tests, together (their fixtures set up once), beside it. Alone, the cluster's stream
    keeps 2 cores about two-thirds busy; the rest (parsing, planning, the journeys run as subprocesses) fills the
    other third."""
    from xdist.scheduler import LoadScopeScheduling

    on_cluster = _tests_on_the_cluster()

    class TwoStreams(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path, _, test = nodeid.partition("::")
            module, name = path.rsplit("/", 1)[-1], re.split(r"[\[:]", test, maxsplit=1)[0]
            return "the cluster" if name in on_cluster.get(module, ()) else path

    return TwoStreams(config, log)


def _tests_on_the_cluster() -> dict[str, set[str]]:
    """Per test module, the tests (functions, classes) that run in the cluster's stream: those that take the
    session's cluster or a fixture that takes it (as an argument or by `usefixtures`, theirs or the module's), and
    any that takes a fixture of its module's own (set up once per module and stream: split over both streams, it
    would be built twice). Read from the source: xdist's controller schedules by node ids alone, before any fixture
    is resolved."""
    here = Path(__file__).read_text()
    cluster = {"ray_cluster", *re.findall(r"^def (\w+)\([^)]*\bray_cluster\b", here, flags=re.M)}
    found = {}
    for path in Path(__file__).parent.glob("test_*.py"):
        body = ast.parse(path.read_text()).body
        marks = {c.value for n in body if isinstance(n, ast.Assign) for c in ast.walk(n) if isinstance(c, ast.Constant)}
        fixtures = {n.name: _takes(n) for n in body if isinstance(n, ast.FunctionDef) and _is_fixture(n)}
        whole = bool(marks & cluster) or any("autouse=True" in ast.unparse(d) for n in body for d in _decorators(n))
        tests = {
            n.name: n
            for n in body
            if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name.startswith(("test", "Test"))
        }
        on = {
            name
            for name, node in tests.items()
            if whole or isinstance(node, ast.ClassDef) or _takes(node) & (cluster | set(fixtures))
        }
        if (
            whole
            or any(takes & cluster for takes in fixtures.values())
            or any(_takes(n) & cluster for n in tests.values())
        ):
            found[path.name] = on
    return found


def _decorators(node: ast.stmt) -> list[ast.expr]:
    return getattr(node, "decorator_list", [])


def _is_fixture(node: ast.FunctionDef) -> bool:
    return any("fixture" in ast.unparse(d) for d in node.decorator_list)


def _takes(node: ast.FunctionDef | ast.ClassDef) -> set[str]:
    """The fixtures a test or fixture asks for: its arguments and the names its `usefixtures` marks give."""
    args = {a.arg for a in node.args.args} if isinstance(node, ast.FunctionDef) else set()
    marked = [d for d in node.decorator_list if "usefixtures" in ast.unparse(d)]
    return args | {c.value for d in marked for c in ast.walk(d) if isinstance(c, ast.Constant)}


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    def expired(signum, frame):  # noqa: ANN001
        pytest.fail(f"fixture {fixturedef.argname!r} took over {FIXTURE_TIMEOUT_S} s to set up")

    previous = signal.signal(signal.SIGALRM, expired)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, FIXTURE_TIMEOUT_S)  # a fixture set up inside another's
    try:
        return (yield)
    finally:
        signal.setitimer(signal.ITIMER_REAL, outer)
        signal.signal(signal.SIGALRM, previous)


def _cpu_busy_s() -> float:
    """Seconds of CPU time the whole machine has spent busy (every process, every core), from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With DISTRAIN_TEST_TIMES=<file>: each test's wall seconds (setup, call, teardown) and the machine's busy CPU
    seconds meanwhile, a line each, to find where the suite's time goes and whether it waits or computes."""
    out = os.environ.get("DISTRAIN_TEST_TIMES")
    if not out:
        return (yield)
    wall, busy = time.monotonic(), _cpu_busy_s()
    try:
        return (yield)
    finally:
        with open(out, "a") as f:
            f.write(f"{time.monotonic() - wall:.2f} {_cpu_busy_s() - busy:.2f} {item.nodeid.split('@')[0]}\n")


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from distrain.cluster.runtime import connect

    connect(None, num_cpus=CLUSTER_CPUS, num_gpus=0)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A real S3-compatible store (SeaweedFS on loopback, free ports, data in tmp) for the session, its key,
    secret and endpoint in this process's environment as a user's would be (the driver forwards AWS_* to the
    workers); ended by its PID, also on failure."""
    from distrain.testing.seaweed import Seaweed

    yield from serving(Seaweed(tmp_path_factory.mktemp("seaweed")))


@pytest.fixture(scope="session")
def gcs(tmp_path_factory):
    """GCS's stand-in, gcp-storage-emulator, as `s3` is SeaweedFS (distrain/testing/emulators.py)."""
    from distrain.testing.emulators import GcsEmulator

    yield from serving(GcsEmulator(tmp_path_factory.mktemp("gcs")))


@pytest.fixture(scope="session")
def azure(tmp_path_factory):
    """Azure Blob Storage's stand-in, Azurite (npm, installed by `make setup`), as `s3` is SeaweedFS."""
    from distrain.testing.emulators import Azurite

    yield from serving(Azurite(tmp_path_factory.mktemp("azurite")))


@pytest.fixture(scope="module", params=["s3", "gcs", "azure"])
def store_server(request):
    """Each object store in turn, for the object-storage tests' core (docs/object-storage.md#stores-tested): the
    session's server of that kind, started by the first test that asks for it. Module-scoped, so that pytest
    groups a module's tests by store there, not the session's (which would set a module's fixtures up again)."""
    return request.getfixturevalue(request.param)


def serving(server):
    """`server` started, its client variables in this process's environment (the driver forwards them to the
    workers) while it serves; ended by its PID, the environment restored, also on failure."""
    server.start()
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def final_weights(cfg: TrainConfig) -> dict:
    """The model weights of the run's newest committed checkpoint (a LoRA run's: its adapters, all it saves), read
    without a process group."""
    import torch.distributed.checkpoint as dcp

    from distrain.model.lora import add_adapters, is_adapter
    from distrain.model.registry import build_model
    from distrain.storage import checkpoint

    path = checkpoint.latest(Path(cfg.run_dir) / "checkpoints")
    model = add_adapters(build_model(cfg.model, cfg.trainer.seq_len), cfg.finetune.lora, cfg.trainer.seed)
    lora = cfg.finetune.lora.rank > 0
    state = {"model": {k: v for k, v in model.state_dict().items() if is_adapter(k) or not lora}}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state["model"]


def assert_recovery_in_order(timings: dict, after: float, logged_at: float | None = None, context: str = "") -> None:
    """An attempt's marks (summary.json → attempts → timings) one after another: from the failure the
    supervisor saw, no earlier than `after` (what the test did to cause it), through its placement group,
    actors, calls, the ranks' imports, rendezvous and load, to the first step, no later than `logged_at`
    (that step's metrics line) when given, and its end once it has one. A group refilled or kept has no
    reservation of its own."""
    marks = [timings[m] for m in Mark if m in timings or m not in (Mark.RESERVED, Mark.ENDED)]
    assert after <= marks[0] and marks == sorted(marks), (timings, context)
    assert logged_at is None or timings[Mark.FIRST_STEP] <= logged_at, (timings, logged_at, context)


@pytest.fixture(scope="session")
def tracked_run(ray_cluster, tmp_path_factory) -> tuple[Path, dict, dict]:
    """A run that every record of its progress is checked on (tests/test_wandb.py, tests/test_plot.py): W&B
    offline with checkpoint artifacts, TensorBoard, validation every 2 steps; 4 steps, then a rerun to 6
    (a second invocation: a restart from step 4). Its directory and both invocations' summaries."""
    from distrain.driver.launch import train

    storage = tmp_path_factory.mktemp("tracked")
    common = [
        "run.name=w",
        "logger.wandb.mode=offline",
        "logger.wandb.log_checkpoints=true",
        "logger.tensorboard=true",
        "checkpoint.interval=2",
        "trainer.eval_interval=2",
        "optim.lr=0.002",
    ]
    first = train(make_config(storage, *common, "trainer.max_steps=4"))
    second = train(make_config(storage, *common, "trainer.max_steps=6"))
    return storage / "w", first, second


def logged(cfg: TrainConfig, key: str = "loss") -> dict[int, float]:
    """step → the value of `key` in the run's metrics.jsonl."""
    from distrain.storage.tracking import read_metrics

    return {m["step"]: m[key] for m in read_metrics(cfg.run_dir)}


def assert_logged_as(cfg: TrainConfig, reference: dict[int, float], resumed: list[int]) -> None:
    """Every logged loss equal to the reference's to the last bit. A failure at a random moment may land while
    the step before it has its loss summed over the ranks (read back a step late), which then no rank can
    know: that step's line may be missing, and only for a step a recovery resumed from (`resumed`)."""
    lines = logged(cfg)
    assert set(reference) - set(lines) <= set(resumed), (sorted(set(reference) - set(lines)), resumed)
    assert lines == {step: loss for step, loss in reference.items() if step in lines}


def assert_matches(cfg: TrainConfig, reference: dict, steps: range, tol: float) -> None:
    """The run's loss and gradient norm at each of `steps` are the reference run's ({"loss": {step: value},
    "grad_norm": ...}), within `tol` absolute or relative."""
    for key in ("loss", "grad_norm"):
        got = logged(cfg, key)
        for step in steps:
            assert got[step] == pytest.approx(reference[key][step], rel=tol, abs=tol), f"{key} at step {step}"


LayoutArgs = tuple[int, list[str]]  # a layout as a test gives it: (workers, overrides)


def train_half_then_resume(
    storage: Path, name: str, first: LayoutArgs, then: LayoutArgs, steps: int, *common: str
) -> TrainConfig:
    """Run `name` for `steps` steps in two invocations: the first half under `first`, the rest resumed from its
    checkpoint under `then`, on the whole run's LR schedule. The second's config: its run holds every step."""
    from distrain.driver.launch import train

    half = steps // 2
    for (workers, overrides), max_steps in zip((first, then), (half, steps), strict=True):
        cfg = make_config(
            storage,
            f"run.name={name}",
            f"cluster.num_workers={workers}",
            *common,
            *overrides,
            f"trainer.max_steps={max_steps}",
            f"optim.decay_steps={steps}",
        )
        summary = train(cfg)
        assert summary["status"] == "completed"
    assert summary["resumed_from"].endswith(f"step_{half:08d}")  # the second layout did resume
    return cfg


@pytest.fixture(scope="session")
def process_group():
    """A one-rank gloo group on loopback, for parallel-layer and checkpoint tests without Ray."""
    from distrain.parallel import process_group as pg

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    pg.init_from_env()
    yield
    pg.destroy()


def logged_step(run_dir: Path) -> int:
    """The newest step in the run's metrics.jsonl, 0 before there is one (rank 0 may be writing its last line)."""
    import json

    path, step = run_dir / "metrics.jsonl", 0
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            step = max(step, json.loads(line)["step"])
        except ValueError:
            pass
    return step


def committed_step(run_dir: Path) -> int:
    """The step of the run's newest committed checkpoint right now, 0 if none."""
    newest = checkpoint.latest(run_dir / "checkpoints")
    return checkpoint.read_meta(newest)["step"] if newest else 0


def attempt_placement(run_dir: Path, attempt: int | None = None) -> list[dict] | None:
    """An attempt's placement file (None: the current one, placement.json); None until it is written whole."""
    import json

    path = run_dir / ("placement.json" if attempt is None else f"attempts/{attempt:03d}-placement.json")
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):  # not yet, or being written
        return None


def fake_table(n: int, per_node: int, gpus: bool) -> list[RankPlace]:
    """What WorkerGroup.start returns, for n workers on nodes of per_node workers each."""
    return [
        RankPlace(
            node_id=f"node{r // per_node}",
            node_ip=f"10.0.0.{r // per_node + 1}",
            interface="eth0",
            gpu_ids=[r % per_node] if gpus else [],
            pid=1000 + r,
            bundle=r,
            rank=r,
            worker_index=n - 1 - r,
            node_rank=r // per_node,
            local_rank=r % per_node,
            local_world_size=per_node,
        )
        for r in range(n)
    ]


# -- a run under fire: what a test does beside train() ------------------------------------------------


def when(condition: Callable[[], bool], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(0.002)


def workers(run_dir: Path) -> list[dict]:
    """The ranks of the current attempt (placement.json also lists hot spares and servers)."""
    return [e for e in json.loads((run_dir / "placement.json").read_text()) if "rank" in e]


def in_background(fn: Callable[[], None]) -> threading.Thread:
    """The helper runs beside train(), which keeps the main thread (it takes SIGTERM there)."""
    errors = []

    def guarded() -> None:
        try:
            fn()
        except BaseException as e:  # reported by the test, not lost in a thread
            errors.append(e)

    thread = threading.Thread(target=guarded, daemon=True)
    thread.errors = errors
    thread.start()
    return thread
