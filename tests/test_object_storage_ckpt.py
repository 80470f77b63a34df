"""Checkpoints on a real object store (SeaweedFS on loopback, the `s3` fixture): a run SIGKILLed while a
checkpoint's objects are being uploaded resumes from the last one committed on the store, bitwise as an
uninterrupted run on local storage; a run resumes from the URL alone, its local mirror deleted, on another
layout; a store stopped mid-run costs a checkpoint, not the run, and the next one commits once it is back. The
commit and the kill mid-upload also on GCS's and Azure's emulators (`store_server`: each store in turn)."""

from __future__ import annotations

import contextlib
import io
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import final_weights, logged, make_config

from distrain.config import ConfigError, StorageConfig
from distrain.driver.launch import train
from distrain.driver.trained import checkpoint_path, load_trained
from distrain.storage import checkpoint, remote, saver
from distrain.storage.checkpoint import COMMIT_MARKER
from distrain.storage.objectstore import store_for

pytestmark = pytest.mark.usefixtures("s3")
# A fixed LR schedule (decay_steps), so that a run of 6 steps extended to 8 trains the reference's 8 steps.
COMMON = [
    "cluster.num_workers=2",
    "checkpoint.interval=2",
    "optim.decay_steps=12",
    "cluster.restart_backoff_s=0",
]
# A stopped store fails each operation at once (one try of botocore's, one of Store's) instead of retrying
# for seconds: a checkpoint that cannot be written is given up quickly.
FAST_OPTIONS = {"config_kwargs": {"connect_timeout": 1, "read_timeout": 5, "retries": {"max_attempts": 1}}}
# DDP → ZeRO-3 differs only in the order of the sums: test_elastic.py's tolerance for a reshard.
TOLERANCE = 1e-4


def store_config(server, tmp: Path, name: str, *overrides: str):
    """A run on the store (run.storage=s3://runs/ckpt, or the server's), its local mirror under `tmp`."""
    cfg = make_config(tmp, *COMMON, f"run.name={name}", f"storage.cache_dir={tmp / 'cache'}", *overrides)
    cfg.run.storage = server.url("ckpt")
    return replace(cfg, storage=replace(cfg.storage, options=dict(server.options)))


@pytest.mark.usefixtures("process_group")
def test_what_is_on_the_store_is_checked_before_it_is_loaded(s3, tmp_path: Path, capsys):
    """In one process: saves committed on the store, retention there (a torn prefix never takes a keep
    slot; one older than those kept goes; one newer stays, skipped); bytes overwritten in an object of the
    newest (its size unchanged) fail its checksum once downloaded: the older one is loaded, in one line."""
    store = store_for(s3.url("ckpt", "inproc"), StorageConfig())
    for step in (1, 5, 9):  # dead saves'
        store.write_bytes(f"checkpoints/step_{step:08d}/__0_0.distcp", b"torn")
    writer = saver.Saver(tmp_path / "mirror", keep=2, background=True, remote=remote.Remote(store))
    model = torch.nn.Linear(8, 8)
    for step in (2, 4, 6):
        writer.save(step, {"model": model.state_dict()}, {"step": step, "world_size": 1}, {})
    writer.close()
    assert list(remote.on_store(store)) == ["step_00000009", "step_00000006", "step_00000005", "step_00000004"]
    assert remote.latest_meta(store)[0] == "step_00000006"
    shard = "checkpoints/step_00000006/__0_0.distcp"
    data = bytearray(store.read_bytes(shard))
    data[-64:] = bytes(64)
    store.write_bytes(shard, bytes(data))
    capsys.readouterr()
    path = remote.fetch(store, tmp_path / "elsewhere")
    assert path == tmp_path / "elsewhere" / "step_00000004" and checkpoint.problem(path) is None
    said = capsys.readouterr().err
    assert f"skipping checkpoint {store.url}/checkpoints/step_00000006: __0_0.distcp no longer matches" in said


@pytest.mark.usefixtures("process_group")
def test_export_of_a_run_on_the_store_without_a_whole_checkpoint_is_refused_in_one_line(s3, tmp_path: Path):
    """What export and generate read (driver/trained.py): a run whose saves on the store never committed, then
    one whose only commit is damaged there, each in one line."""
    url, local = s3.url("ckpt", "export"), StorageConfig(cache_dir=str(tmp_path / "cache"))
    store = store_for(url, local)
    store.write_bytes("checkpoints/step_00000001/__0_0.distcp", b"torn")
    with pytest.raises(ConfigError, match=f"run {url} has no committed checkpoint yet on the object store"):
        checkpoint_path(url, storage=local)
    writer = saver.Saver(tmp_path / "mirror", keep=2, background=False, remote=remote.Remote(store))
    writer.save(2, {"model": torch.nn.Linear(8, 8).state_dict()}, {"step": 2, "world_size": 1}, {})
    writer.close()
    with pytest.raises(ConfigError, match=f"run {url} has no committed checkpoint of step=4 on the object store"):
        checkpoint_path(url, step=4, storage=local)
    shard = "checkpoints/step_00000002/__0_0.distcp"
    data = bytearray(store.read_bytes(shard))
    data[-64:] = bytes(64)
    store.write_bytes(shard, bytes(data))
    with pytest.raises(ConfigError) as err:
        checkpoint_path(url, storage=local)
    assert "step_00000002" in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.usefixtures("process_group")
def test_a_nodes_damaged_copy_is_fetched_again_not_skipped(s3, tmp_path: Path):
    """A checkpoint downloaded into a node's mirror, then damaged there at its size: the next fetch checks the
    copy by its checksums and downloads it again, rather than falling back to an older checkpoint (steps lost)."""
    store = store_for(s3.url("ckpt", "mirror-damage"), StorageConfig())
    writer = saver.Saver(tmp_path / "writer", keep=2, background=False, remote=remote.Remote(store))
    for step in (2, 4):
        writer.save(step, {"model": torch.nn.Linear(8, 8).state_dict()}, {"step": step, "world_size": 1}, {})
    writer.close()
    node = tmp_path / "node"
    path = remote.fetch(store, node)
    assert path == node / "step_00000004"
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-64:] = bytes(64)
    shard.write_bytes(bytes(data))
    assert remote.fetch(store, node) == path and checkpoint.problem(path) is None
    assert shard.read_bytes() == store.read_bytes("checkpoints/step_00000004/__0_0.distcp")


def test_a_checkpoint_the_store_holds_short_or_lacks_is_not_committed(store_server, tmp_path: Path):
    """Rank 0 commits on the store only when every rank's object is there at the size that rank wrote: an object
    cut short, or missing, leaves the step uncommitted with one line naming the rank, the object and both sizes."""
    store = store_for(store_server.url("ckpt", "short"), StorageConfig(options=dict(store_server.options)))
    prefix = "checkpoints/step_00000003"
    views = [  # (what each rank wrote: name → size, its checksums, its upload error)
        ({".metadata": 4, "__0_0.distcp": 8}, {".metadata": 1, "__0_0.distcp": 2}, None),
        ({"__1_0.distcp": 8}, {"__1_0.distcp": 3}, None),
    ]
    store.write_bytes(f"{prefix}/.metadata", b"meta")
    store.write_bytes(f"{prefix}/__0_0.distcp", b"rank0...")
    said: list[str] = []
    committer = remote.Remote(store, say=said.append)
    for held, seen in ((b"", "no such object"), (b"rank1", "5 bytes")):
        if held:
            store.write_bytes(f"{prefix}/__1_0.distcp", held)
        assert committer.commit_on_store(prefix, 3, views, keep=2) is None
        assert said.pop() == (
            f"checkpoint of step 3 is not committed on {store.url}/{prefix}: rank 1 uploaded __1_0.distcp (8 bytes), "
            f"the store has {seen}; training goes on, the next checkpoint tries again"
        )
        assert COMMIT_MARKER not in remote.on_store(store)["step_00000003"]
    store.write_bytes(f"{prefix}/__1_0.distcp", b"rank1...")
    assert committer.commit_on_store(prefix, 3, views, keep=2)["crc32"] == {
        ".metadata": 1,
        "__0_0.distcp": 2,
        "__1_0.distcp": 3,
    }
    assert said == [] and COMMIT_MARKER in remote.on_store(store)["step_00000003"]


@pytest.fixture(scope="module")
def reference(s3, ray_cluster, tmp_path_factory) -> dict:
    """The uninterrupted run on local storage, 8 steps: its losses and final weights."""
    cfg = make_config(tmp_path_factory.mktemp("local"), *COMMON, "run.name=reference", "trainer.max_steps=8")
    assert train(cfg)["restarts"] == 0
    return {"loss": logged(cfg), "grad_norm": logged(cfg, "grad_norm"), "weights": final_weights(cfg)}


@pytest.fixture(scope="module")
def killed(store_server, ray_cluster, tmp_path_factory, reference) -> tuple:
    """6 steps on the store, rank 1 SIGKILLed while step 4's checkpoint is uploading (once its first object
    is there), restarted by the supervisor: its config, summary and what the driver said."""
    tmp = tmp_path_factory.mktemp(f"killed-{store_server.scheme}")
    # From the checkpoint, not the live replica's memory (which a 2-worker DDP run would take): the torn step 4.
    kill = ["fault.kill_at_step=4", "fault.kill_rank=1", "fault.kill_mid_upload=true", "cluster.peer_recovery=false"]
    cfg = store_config(store_server, tmp, "killed", "trainer.max_steps=6", *kill)
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        summary = train(cfg)
    return cfg, summary, said.getvalue()


def test_a_run_killed_mid_upload_resumes_from_the_store_bitwise(store_server, killed, reference):
    """The torn checkpoint of step 4 (rank 1's first object on the store, the rest never) is skipped, in one
    line; the run resumes from step 2, committed there, and trains exactly the uninterrupted local run."""
    cfg, summary, said = killed
    assert summary["status"] == "completed" and summary["restarts"] == 1
    assert summary["attempts"][1]["info"]["resumed_from_step"] == 2
    torn = f"skipping checkpoint {store_server.url('ckpt', 'killed', 'checkpoints', 'step_00000004')}: no commit marker"
    assert torn in said, said[-3000:]
    assert logged(cfg) == {step: reference["loss"][step] for step in range(1, 7)}
    # On the store: the last two commits (retention), whole, with nothing of the torn save left.
    store = store_for(cfg.run_url, cfg.storage)
    found = remote.on_store(store)
    assert list(found) == ["step_00000006", "step_00000004"]
    assert all(remote.problem_on_store(store, name, objects) is None for name, objects in found.items())


@pytest.mark.parametrize("store_server", ["s3"], indirect=True)  # S3's run only: the core is the kill, above
def test_a_run_resumes_from_the_url_alone_on_another_layout(store_server, killed, reference, tmp_path):
    """The killed run's mirror deleted, then extended to 8 steps on ZeRO-3: the checkpoint comes from the
    store (verified by its checksums), the losses and weights are the reference's; and the trained model
    loads from the URL in one process (export, generate) into a mirror of its own."""
    cfg, _, _ = killed
    shutil.rmtree(cfg.run_dir)
    again = store_config(
        store_server, Path(cfg.storage.cache_dir).parent, "killed", "trainer.max_steps=8", "strategy=zero3"
    )
    summary = train(again)
    assert summary["status"] == "completed" and summary["attempts"][0]["info"]["resumed_from_step"] == 6
    got = logged(again)
    for step in (7, 8):
        assert got[step] == pytest.approx(reference["loss"][step], abs=TOLERANCE, rel=TOLERANCE), step
    weights = final_weights(again)
    for name, tensor in reference["weights"].items():
        torch.testing.assert_close(weights[name], tensor, atol=TOLERANCE, rtol=0, msg=name)
    elsewhere = replace(again.storage, cache_dir=str(tmp_path / "elsewhere"))
    trained_cfg, model = load_trained(again.run_url, storage=elsewhere)
    assert trained_cfg.strategy.zero == 3
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name


@pytest.mark.timeout(180)
def test_a_store_stopped_mid_run_costs_a_checkpoint_not_the_run(s3, ray_cluster, tmp_path, capfd):
    """The store stops before step 1 (the run held there); the checkpoint of step 2 cannot be uploaded: it is
    not committed, one line says so, the steps go on. The run is held again, the store started, and the
    later checkpoints commit; the run completes with every step trained."""
    hold = tmp_path / "hold"
    hold.write_text("")
    cfg = store_config(s3, tmp_path, "outage", "trainer.max_steps=12", f"fault.hold_file={hold}")
    cfg = replace(cfg, storage=replace(cfg.storage, retries=1, backoff_s=0.1, options=FAST_OPTIONS))
    errors: list[BaseException] = []

    def outage() -> None:
        try:
            when(lambda: (Path(cfg.run_dir) / "placement.json").exists())
            s3.stop()
            hold.unlink()
            # Step 4's save has begun, so step 2's has ended (one save at a time); then the run is held.
            when((Path(cfg.run_dir) / "checkpoints" / "step_00000004" / "meta.json").exists)
            hold.write_text("")
            s3.start()
            hold.unlink()
        except BaseException as e:  # reported by the test, not lost in a thread
            errors.append(e)

    helper = threading.Thread(target=outage, daemon=True)
    helper.start()
    try:
        summary = train(cfg)
    finally:
        helper.join(timeout=60)
        hold.unlink(missing_ok=True)
        if s3.proc is None:
            s3.start()
    assert not errors, errors
    said = capfd.readouterr()
    lines = [line for line in (said.err + said.out).splitlines() if "is not committed on" in line]
    where = s3.url("ckpt", "outage", "checkpoints", "step_00000002")
    assert any(f"checkpoint of step 2 is not committed on {where}: " in line for line in lines), lines
    assert summary["status"] == "completed" and summary["restarts"] == 0
    assert sorted(logged(cfg)) == list(range(1, 13))
    store = store_for(cfg.run_url, cfg.storage)
    found = remote.on_store(store)
    assert "step_00000012" in found and remote.problem_on_store(store, "step_00000012", found["step_00000012"]) is None
    assert "step_00000002" not in found or COMMIT_MARKER not in found["step_00000002"]


def when(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(0.005)
