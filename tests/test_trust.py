"""The run directory is a trust boundary: shared storage other people and jobs can write. A file
planted in a checkpoint is refused with one line and never run; no secret is written into the run
directory; the embedded cluster listens on loopback only."""

from __future__ import annotations

import ipaddress
import json
import os
import pickle
import uuid
import zlib
from pathlib import Path

import pytest
import ray
import torch
import torch.distributed.checkpoint as dcp
from conftest import make_config
from torch import nn

from distrain.cluster.placement import WorkerFailure
from distrain.driver.launch import train
from distrain.driver.validation import validate
from distrain.driver.workers import group_spec
from distrain.model.llama import Transformer
from distrain.ps.job import ServerJob
from distrain.ps.server import SERVER_FILE, ParameterServer, load_weights
from distrain.storage import checkpoint, safeload, saver


class Planted:
    """What an attacker would plant: unpickling it calls Path.touch(marker), a harmless stand-in for
    any callable (os.system...); the marker's existence afterwards proves the call ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def plant(file: Path, obj: object, fmt: str = "torch") -> None:
    """Replace `file` with `obj`, in torch.save's format or as a bare pickle."""
    with open(file, "wb") as f:
        torch.save(obj, f) if fmt == "torch" else pickle.dump(obj, f)


def assert_refused(error: pytest.ExceptionInfo, file: str) -> None:
    message = str(error.value)
    assert "\n" not in message and file in message, message
    assert "not only tensors and plain data" in message and "resume from another checkpoint" in message, message


# -- collective checkpoints (one gloo rank, no Ray) --------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", ["torch", "pickle"])
def test_a_rank_file_holding_a_callable_is_refused_not_run(process_group, tmp_path: Path, fmt: str):
    """checkpoint.load torch.loads each rank's own file (its RNG state): one that holds a callable
    raises UnsafeCheckpointError, one line naming the file, and the callable never runs."""
    model, marker = nn.Linear(2, 2), tmp_path / "ran"
    path = saver.save(tmp_path / "ckpt", 1, {"model": model.state_dict()}, {"step": 1, "world_size": 1}, {}, 1)
    rank_file = path / "rank_00000.pt"
    plant(rank_file, {"cpu_rng": Planted(marker)}, fmt)
    with pytest.raises(safeload.UnsafeCheckpointError) as error:
        checkpoint.load(path, {"model": model.state_dict()})
    assert_refused(error, str(rank_file))
    assert not marker.exists()


@pytest.mark.timeout(60)
def test_dcp_metadata_naming_a_callable_is_refused_not_run(process_group, tmp_path: Path):
    """DCP unpickles its `.metadata` with plain pickle: there only DCP's own record classes are
    allowed, and the refusal comes out as itself, not inside DCP's wrapped errors."""
    model, marker = nn.Linear(2, 2), tmp_path / "ran"
    path = saver.save(tmp_path / "ckpt", 1, {"model": model.state_dict()}, {"step": 1, "world_size": 1}, {}, 1)
    plant(path / ".metadata", Planted(marker), "pickle")
    with pytest.raises(safeload.UnsafeCheckpointError) as error:
        checkpoint.load(path, {"model": model.state_dict()})
    assert_refused(error, str(path / ".metadata"))
    assert "pathlib.Path" in str(error.value) and not marker.exists()


@pytest.mark.timeout(60)
def test_a_non_tensor_item_holding_a_callable_is_refused_not_run(process_group, tmp_path: Path):
    """DCP torch.loads a non-tensor item with weights_only=False: a checkpoint whose item holds a
    callable is refused; a plain one (a dict of numbers) still loads."""
    model, marker = nn.Linear(2, 2), tmp_path / "ran"
    meta = {"step": 1, "world_size": 1}
    plain = saver.save(tmp_path / "plain", 1, {"model": model.state_dict(), "extra": {"a": 1}}, meta, {}, 1)
    state = {"model": model.state_dict(), "extra": {"a": 0}}
    checkpoint.load(plain, state)
    assert state["extra"] == {"a": 1}

    planted = {"model": model.state_dict(), "extra": Planted(marker)}
    with pytest.raises(TypeError, match="holds extra"):  # distrain never writes one
        saver.save(tmp_path / "ckpt", 1, planted, meta, {}, 1)
    assert not (tmp_path / "ckpt").exists()
    path = checkpoint.prepare(tmp_path / "ckpt", 1)  # someone else's, written straight with DCP
    dcp.save(planted, checkpoint_id=str(path))
    with pytest.raises(safeload.UnsafeCheckpointError) as error:
        checkpoint.load(path, {"model": model.state_dict(), "extra": None})
    assert_refused(error, f"item extra of {path}")
    assert not marker.exists()


# -- parameter-server checkpoints -----------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_server_file_holding_a_callable_is_refused_not_run(tmp_path: Path):
    """A parameter server restoring its shard, and load_weights reading a checkpoint's shards, refuse
    a shard file that holds a callable; a genuine one (its pieces are Piece records) still loads."""
    marker = tmp_path / "ran"
    cfg = make_config(tmp_path, "run.name=trust", "strategy=ps", "ps=async", "cluster.num_workers=1")
    validate(cfg)
    job = ServerJob(cfg)
    saved = ParameterServer(job, 0)
    saved.save("ckpt")  # a staging directory of the run's checkpoints
    folder = Path(cfg.run_dir) / "checkpoints" / "ckpt"
    resumed = ServerJob(cfg, str(folder))
    assert torch.equal(ParameterServer(resumed, 0).flat, saved.flat)
    model = Transformer(cfg.model, cfg.trainer.seq_len)
    load_weights(folder, model)

    shard_file = folder / SERVER_FILE.format(0)
    plant(shard_file, {"pieces": Planted(marker)})
    with pytest.raises(safeload.UnsafeCheckpointError) as error:
        ParameterServer(resumed, 0)
    assert_refused(error, str(shard_file))
    with pytest.raises(safeload.UnsafeCheckpointError) as error:
        load_weights(folder, model)
    assert_refused(error, str(shard_file))
    assert not marker.exists()


# -- whole runs on the session's cluster ----------------------------------------------------------


@pytest.mark.timeout(180)
def test_a_resumed_run_refuses_a_planted_rank_file_and_fails(ray_cluster, tmp_path: Path):
    """A planted rank file, with the commit manifest rewritten to its size and checksum as an attacker who
    can write the directory would: the resuming run fails with the refusal and the callable never runs."""
    common = ("run.name=planted", "cluster.num_workers=1", "checkpoint.interval=2", "checkpoint.keep=1")
    cfg = make_config(tmp_path, *common, "trainer.max_steps=2")
    train(cfg)
    path, marker = checkpoint.latest(Path(cfg.run_dir) / "checkpoints"), tmp_path / "ran"
    plant(path / "rank_00000.pt", {"cpu_rng": Planted(marker)})
    manifest = json.loads((path / checkpoint.COMMIT_MARKER).read_text())
    manifest["files"]["rank_00000.pt"] = (path / "rank_00000.pt").stat().st_size
    manifest["crc32"]["rank_00000.pt"] = zlib.crc32((path / "rank_00000.pt").read_bytes())
    (path / checkpoint.COMMIT_MARKER).write_text(json.dumps(manifest))

    with pytest.raises(WorkerFailure, match="UnsafeCheckpointError: refused to load"):
        train(make_config(tmp_path, *common, "trainer.max_steps=4"))
    assert not marker.exists()


@pytest.mark.timeout(180)
def test_no_secret_reaches_the_run_directory(ray_cluster, tmp_path: Path, monkeypatch):
    """A run with a W&B API key in the environment (forwarded to the workers, which log to W&B) and W&B
    offline: no file under the test's directory (run directory, W&B's offline run and its config,
    cache and data folders) holds the key, nor Ray's auth token."""
    key = f"fake-wandb-key-{uuid.uuid4().hex}"
    monkeypatch.setenv("WANDB_API_KEY", key)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    cfg = make_config(
        tmp_path,
        "run.name=secrets",
        "logger.wandb.mode=offline",
        "cluster.num_workers=1",
        "cluster.reuse_workers=false",  # a fresh worker, gone at the end with the key in its environment
        "trainer.max_steps=2",
        "checkpoint.interval=2",
    )
    assert dict(group_spec(cfg, validate(cfg)).env)["WANDB_API_KEY"] == key  # the workers do get it
    assert train(cfg)["status"] == "completed"
    assert any((Path(cfg.run_dir) / "wandb").glob("offline-run-*/run-*.wandb"))  # its config, history, logs

    secrets = {"WANDB_API_KEY": key.encode()}
    token = Path.home() / ".ray" / "auth_token"
    if token.exists() and token.read_bytes().strip():
        secrets["~/.ray/auth_token"] = token.read_bytes().strip()
    files = [f for f in tmp_path.rglob("*") if f.is_file()]
    assert len(files) > 10
    leaks = [(name, str(f)) for f in files for name, secret in secrets.items() if secret in f.read_bytes()]
    assert not leaks


def loopback(ip: str) -> bool:
    """127.0.0.0/8 or ::1, also as an IPv4-mapped IPv6 address (::ffff:127.0.0.1)."""
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def session_processes(session: str) -> dict[int, str]:
    """pid → name of every process of a Ray session: those whose command line names it (GCS, raylet,
    monitors) and their descendants (agents, workers, whose command lines Ray rewrites)."""
    import psutil  # Ray's own copy, on the path once Ray is imported

    found = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(session in arg for arg in p.info["cmdline"] or ()):
                found.update({q.pid: q.name() for q in [p, *p.children(recursive=True)]})
        except psutil.NoSuchProcess:
            pass  # ended meanwhile (an idle worker): it listens on nothing now
    return found


@pytest.mark.timeout(60)
def test_the_embedded_cluster_listens_on_loopback_only(ray_cluster):
    """Every TCP socket (IPv4 and IPv6) listening in the session cluster's processes is bound to
    loopback. The driver, this test process, is left out: it also holds sockets that are not Ray's."""
    import psutil

    processes = session_processes(ray._private.worker.global_worker.node.session_name)
    listening = [
        (processes[c.pid], c.laddr.ip, c.laddr.port)
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.pid in processes
    ]
    assert {"gcs_server", "raylet"} <= {name for name, _, _ in listening}, listening
    assert [s for s in listening if not loopback(s[1])] == [], listening


@pytest.mark.timeout(30)
def test_the_rendezvous_store_of_a_loopback_group_listens_on_loopback_only(process_group):
    """A group formed by init_from_env with MASTER_ADDR on loopback, as the embedded cluster's ranks form
    theirs: rank 0's rendezvous store (MASTER_PORT, here in this process) listens on loopback only."""
    import psutil  # Ray's own copy, on the path once Ray is imported

    port = int(os.environ["MASTER_PORT"])
    store = [
        c.laddr.ip
        for c in psutil.net_connections(kind="tcp")
        if c.pid == os.getpid() and c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]
    assert store and all(loopback(ip) for ip in store), store
