"""A run on an object store, the driver's side (issue 33): run.storage=s3://… checked before anything starts
and never taken for a local path, the run's lock on the store, its record there while it trains and complete
after, a fresh machine's mirror filled from it, and the credentials written nowhere. A real S3-compatible store
(the `s3` fixture: SeaweedFS on loopback); the lock and the run's tests also on GCS's and Azure's emulators
(`store_server`: each store in turn); one 2-worker run through `jobs/train.py` per store shared by the tests."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import REPO, TINY, make_config

from distrain.config import ClusterConfig, ConfigError, recorded
from distrain.driver.launch import _previous_summaries, train
from distrain.driver.objectrun import check_run_url, on_store
from distrain.driver.workers import worker_env
from distrain.storage.fsutil import LockedError
from distrain.storage.objectstore import Store, delete_command, quick_options
from distrain.storage.record_sync import LOCK_OBJECT, RecordSync, record_sync, store_lock
from distrain.storage.tracking import TRACKER_FILES, Tracker

STEPS = 4


def refusal(cfg) -> str:
    """train(cfg) refused in one line; the line."""
    started = time.monotonic()
    with pytest.raises(ConfigError) as refused:
        train(cfg)
    line = str(refused.value)
    assert "\n" not in line and time.monotonic() - started < 10, line
    return line


@pytest.mark.parametrize("plan", [False, True])
def test_a_url_is_checked_before_anything_is_written(s3, tmp_path: Path, monkeypatch, plan: bool):
    """Unknown scheme, closed endpoint, wrong secret: one line naming the URL and the error, for a run and for
    --plan, before Ray or a worker starts; nothing local is made (no 's3:' folder, no mirror)."""
    monkeypatch.chdir(tmp_path)
    common = ("run.name=r", f"storage.cache_dir={tmp_path / 'cache'}", f"plan={plan}")
    line = refusal(make_config("nosuch://bucket/runs", *common))
    assert line.startswith("run.storage='nosuch://bucket/runs': no filesystem for nosuch:// is installed"), line

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: a connection is refused at once
    endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
    with closed:
        line = refusal(make_config(s3.url("refused"), *common, f"+storage.options.endpoint_url={endpoint}"))
    assert f"cannot write the run at {s3.url('refused', 'r')}" in line and "Could not connect" in line, line

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    line = refusal(make_config(s3.url("refused"), *common))
    assert f"cannot write the run at {s3.url('refused', 'r')}" in line and "signature" in line, line
    assert list(tmp_path.iterdir()) == []


def test_a_bucket_that_does_not_exist_is_refused_unless_made(s3, tmp_path: Path, monkeypatch):
    """A misspelt bucket, which SeaweedFS would make at the first write (and the run "complete" there): refused in
    one line naming it, before anything is written, the bucket still absent; storage.create_bucket=true makes it."""
    monkeypatch.chdir(tmp_path)
    made = lambda: Store(s3.url()).fs.ls("", refresh=True)  # noqa: E731  (the store's buckets)
    bucket = f"nosuchbucket-{uuid.uuid4().hex[:8]}"
    common = ("run.name=r", f"storage.cache_dir={tmp_path / 'cache'}")
    line = refusal(make_config(f"s3://{bucket}/team", *common))
    assert line == (
        f"run.storage='s3://{bucket}/team': the bucket '{bucket}' does not exist; check its name, or set "
        "storage.create_bucket=true to create it"
    )
    assert bucket not in made() and list(tmp_path.iterdir()) == []
    Store(f"s3://{bucket}/team").check_bucket("run.storage", create=True)  # made by the check, before any write
    assert bucket in made()
    check_run_url(make_config(f"s3://{bucket}y/team", *common, "storage.create_bucket=true", "plan=true"))
    assert f"{bucket}y" not in made()  # a plan makes none
    check_run_url(make_config(f"s3://{bucket}x/team", *common, "storage.create_bucket=true"))  # the key reaches it
    assert f"{bucket}x" in made()


def test_a_stores_client_says_nothing_of_the_credentials(s3, caplog):
    """botocore's "Found credentials in environment variables." for every client made, in every process's log."""
    caplog.set_level(logging.INFO)
    url = s3.url("quiet")
    assert not Store(url, quick_options(url, {})).exists("x")  # a client of its own: the credentials looked up
    assert [r.getMessage() for r in caplog.records if r.name.startswith(("aiobotocore", "botocore"))] == []


def test_a_sweep_on_a_url_is_refused_in_one_line():
    """Hydra would make the sweep's directory, ${run.storage}/sweeps/…, as a local folder named 's3:'."""
    from distrain.commands import train as job

    with pytest.raises(job.BadInput, match=r"^run.storage='s3://runs/x': a sweep \(-m\) keeps its record in a dir"):
        job.check_sweep_storage(["optim.lr=1e-3,2e-3", "run.storage=s3://runs/x"])


def test_workers_get_the_stores_credentials_from_the_drivers_environment(monkeypatch):
    """Passed with each call (GroupSpec.env, never in its repr, the config or a record)."""
    from distrain.cluster.placement import GroupSpec

    given = {"AWS_SECRET_ACCESS_KEY": "a", "GOOGLE_APPLICATION_CREDENTIALS": "/g.json", "AZURE_STORAGE_KEY": "z"}
    for key, value in given.items():
        monkeypatch.setenv(key, value)
    env = dict(worker_env(ClusterConfig()))
    assert {k: env.get(k) for k in given} == given
    spec = GroupSpec(num_workers=1, cpus_per_worker=1, gpus_per_worker=0, threads_per_worker=1, env=tuple(env.items()))
    assert "AWS_SECRET" not in repr(spec)


def option_overrides(options: dict) -> list[str]:
    return [f"+storage.options.{k}='{v}'" for k, v in options.items()]


def test_the_store_lock_refuses_a_second_holder_and_is_released(store_server):
    """On each store: S3 and Azure refuse a conditional write over the lock; the GCS emulator ignores one (real
    GCS does not), and there the lock is created by a write read back (Store.create), said in one line."""
    store, said = Store(store_server.url("lock"), store_server.options), []
    with store_lock(store, said.append):
        assert store.conditional_writes() == (store_server.scheme != "gs")
        assert len([line for line in said if "ignores conditional writes" in line]) == (not store.conditional_writes())
        holder = json.loads(store.read_bytes(LOCK_OBJECT))
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(LockedError) as refused:
            with store_lock(store):
                pass
        assert f"in use by pid {os.getpid()} " in str(refused.value)
        assert str(refused.value).endswith(delete_command(f"{store.url}/.lock"))
    assert not store.exists(LOCK_OBJECT)
    with pytest.raises(RuntimeError, match="a failure"), store_lock(store):
        raise RuntimeError("a failure")
    assert not store.exists(LOCK_OBJECT)  # released on failure too
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    store.write_bytes(LOCK_OBJECT, json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout)}).encode())
    with store_lock(store):  # its holder died without releasing it: taken over
        assert json.loads(store.read_bytes(LOCK_OBJECT))["pid"] == os.getpid()


def test_of_two_drivers_creating_the_lock_at_once_one_wins(store_server):
    """Two clients create the same object at the same instant, three times: each time exactly one holds it, by
    the store's condition, or on the GCS emulator (which ignores it) by the read-back of Store.create."""
    from concurrent.futures import ThreadPoolExecutor
    from threading import Barrier

    stores = [Store(store_server.url("race"), {**store_server.options, "skip_instance_cache": True}) for _ in "ab"]
    start = Barrier(2)

    def create(i: int, name: str) -> bool:
        start.wait()
        return stores[i].create(name, f"driver {i}".encode())

    with ThreadPoolExecutor(2) as pool:
        assert [s.conditional_writes() for s in stores] == [store_server.scheme != "gs"] * 2
        for n in range(3):
            won = list(pool.map(create, (0, 1), (f"lock-{n}",) * 2))
            assert sorted(won) == [False, True], won
            winner = won.index(True)
            assert stores[0].read_bytes(f"lock-{n}") == f"driver {winner}".encode()


def test_a_sync_uploads_what_changed_and_never_checkpoints_or_hidden_files(s3, tmp_path: Path):
    for name in ("summary.json", "logs/driver-1.log", "hydra/t/.hydra/config.yaml", "checkpoints/x", ".lock"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("1")
    record = RecordSync(Store(s3.url("sync")), tmp_path)
    assert record.sync() == ["hydra/t/.hydra/config.yaml", "logs/driver-1.log", "summary.json"]
    assert record.sync() == []
    (tmp_path / "logs" / "driver-1.log").write_text("12")
    assert record.sync() == ["logs/driver-1.log"]
    fresh = RecordSync(Store(s3.url("sync")), tmp_path / "fresh")
    assert sorted(fresh.pull()) == ["hydra/t/.hydra/config.yaml", "logs/driver-1.log", "summary.json"]
    assert (tmp_path / "fresh" / "logs" / "driver-1.log").read_text() == "12" and fresh.sync() == []


def test_a_nodes_summary_is_refreshed_when_the_store_records_more_invocations(s3, tmp_path: Path):
    """A node's mirror kept summary.json from an earlier invocation while the run went on elsewhere: a pull takes
    the store's, which records more; a mirror that records as many keeps its own (this node is the newest)."""
    store = Store(s3.url("summaries"))
    store.write_bytes("summary.json", json.dumps({"status": "completed", "history": [{"status": "failed"}]}).encode())
    (tmp_path / "summary.json").write_text(json.dumps({"status": "failed", "history": []}))
    assert RecordSync(store, tmp_path).pull() == ["summary.json"]
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"
    (tmp_path / "summary.json").write_text(json.dumps({"status": "running", "history": [{"status": "failed"}]}))
    assert RecordSync(store, tmp_path).pull() == []
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "running"


def test_rank_0s_tracker_uploads_its_files_as_it_logs_and_a_new_node_appends_to_them(s3, tmp_path: Path):
    """Rank 0's metrics on the store while the run trains (a sync on a thread of its own when one is due: at the
    first line, then every sync_interval_s), and at the tracker's close; rank 0 on a node new to the run (an
    empty mirror) continues the store's file."""
    cfg = make_config(s3.url("tracker"), "run.name=t", "storage.sync_interval_s=3600", f"storage.cache_dir={tmp_path}")
    config, store = recorded(dataclasses.asdict(cfg)), Store(cfg.run_url)
    tracker = Tracker(str(tmp_path / "a"), config, 0, None, record_sync(cfg, tmp_path / "a", TRACKER_FILES))
    tracker.log(1, {"loss": 2.0})
    tracker.record.thread.join(timeout=30)  # the due sync the log started: the step did not wait for it
    assert json.loads(store.read_bytes("metrics.jsonl"))["step"] == 1
    tracker.log(2, {"loss": 1.0})  # no sync due for an hour: uploaded by the close
    tracker.close({})
    assert [json.loads(line)["step"] for line in store.read_bytes("metrics.jsonl").splitlines()] == [1, 2]
    elsewhere = Tracker(str(tmp_path / "b"), config, 2, None, record_sync(cfg, tmp_path / "b", TRACKER_FILES))
    elsewhere.log(3, {"loss": 0.5})
    elsewhere.close({})
    assert [json.loads(line)["step"] for line in store.read_bytes("metrics.jsonl").splitlines()] == [1, 2, 3]


def wait_for(what, timeout_s: float, proc: subprocess.Popen):
    """what() once truthy, polled while the run lives; AssertionError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        assert proc.poll() is None, "the run ended first"
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s} s")


@pytest.fixture(scope="module")
def run(ray_cluster, store_server, tmp_path_factory) -> dict:
    """A 2-worker run of 4 steps on the store through `jobs/train.py`, its credentials in the environment and,
    to check their redaction, in storage.options too; pinned before its first step (fault.hold_file) while the
    store is looked at and a second driver tries the same URL. What was seen, and a copy of every object."""
    cwd, tmp = tmp_path_factory.mktemp("cwd"), tmp_path_factory.mktemp("record")
    hold = tmp / "hold"
    hold.touch()
    url = store_server.url("record")
    overrides = [
        *TINY,
        f"trainer.max_steps={STEPS}",
        "cluster.num_workers=2",
        "cluster.local_cpus=2",
        "cluster.local_gpus=0",
        f"run.storage={url}",
        "run.name=r",
        f"storage.cache_dir={tmp / 'cache'}",
        "storage.sync_interval_s=0.2",
        f"fault.hold_file={hold}",
        *option_overrides(store_server.secret_options),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    out = open(tmp / "console.txt", "w")  # noqa: SIM115  (closed below)
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "jobs" / "train.py"), *overrides], cwd=cwd, env=env, stdout=out, stderr=out
    )
    store, seen = Store(f"{url}/r", store_server.options), {}
    try:
        seen["during"] = wait_for(
            lambda: (names := store.listing()) and "placement.json" in names and names, timeout_s=90, proc=proc
        )
        seen["lock"] = json.loads(store.read_bytes(LOCK_OBJECT))
        with pytest.raises(LockedError) as refused:  # a driver on another machine: a mirror of its own
            train(
                make_config(
                    url, "run.name=r", f"storage.cache_dir={tmp / 'other'}", *option_overrides(store_server.options)
                )
            )
        seen["second_driver"], seen["second_left"] = str(refused.value), (tmp / "other").exists()
        hold.unlink()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
    seen["code"], seen["console"] = proc.returncode, (tmp / "console.txt").read_text()
    seen["after"] = store.listing()
    store.download(seen["after"], "", tmp / "store")
    seen.update(cwd=cwd, tmp=tmp, url=url, store=tmp / "store", mirror=Path(make_config(url, *overrides).run_dir))
    return seen


@pytest.mark.timeout(240)
def test_the_record_is_on_the_store_while_the_run_trains_and_complete_after(run):
    assert run["code"] == 0, run["console"][-3000:]
    during = run["during"]
    assert any(n.startswith("logs/driver-") for n in during) and any(n.endswith(".hydra/config.yaml") for n in during)
    assert "summary.json" not in during and "metrics.jsonl" not in during  # pinned before its first step
    after, store = run["after"], run["store"]
    assert {"summary.json", "metrics.jsonl", "placement.json", "attempts/001-placement.json"} <= after.keys()
    assert LOCK_OBJECT not in after
    # The record holds no checkpoint: the only one there is the final one, uploaded and committed by the ranks.
    saved = {n for n in after if n.startswith("checkpoints/")}
    assert {n.split("/")[1] for n in saved} == {
        f"step_{STEPS:08d}"
    } and f"checkpoints/step_{STEPS:08d}/COMMITTED" in saved
    summary = json.loads((store / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_step"] == STEPS
    assert [json.loads(line)["step"] for line in (store / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    (log,) = [n for n in after if n.startswith("logs/driver-")]
    assert f"completed at step {STEPS}" in (store / log).read_text()  # its last line, after the run's end
    assert list(run["cwd"].iterdir()) == []  # no local 's3:' folder: the run lives in the mirror and on the store


@pytest.mark.timeout(240)
def test_a_second_driver_is_refused_while_the_run_holds_the_lock(run):
    line = run["second_driver"]
    assert run["lock"]["host"] == socket.gethostname() and str(run["lock"]["pid"]) in line
    assert line.startswith(f"{run['url']}/r is in use by pid") and "\n" not in line
    assert line.endswith(delete_command(f"{run['url']}/r/.lock"))
    assert not run["second_left"]  # its mirror, made before the lock was refused, removed again


@pytest.mark.timeout(240)
def test_the_secret_is_in_no_file_the_run_wrote(run, store_server):
    """Given in the environment and storage.options (S3's key, Azure's connection string, which holds the account
    key; the GCS emulator takes none: an option its client ignores), it reached the workers (rank 0 uploaded
    metrics.jsonl with it) and is in no file of the mirror, the store, or the console; the record says redacted."""
    assert "metrics.jsonl" in run["after"]
    files = [p for root in (run["tmp"], run["cwd"]) for p in root.rglob("*") if p.is_file()]
    assert len([p for p in files if run["store"] in p.parents]) == len(run["after"])
    assert [str(p) for p in files if store_server.secret.encode() in p.read_bytes()] == []
    (name,) = [k for k, v in store_server.secret_options.items() if store_server.secret in v]
    (config,) = run["store"].glob("hydra/*/.hydra/config.yaml")
    assert f"{name}: <redacted>" in config.read_text()
    overrides = next(run["store"].glob("hydra/*/.hydra/overrides.yaml")).read_text()
    assert f"+storage.options.{name}=<redacted>" in overrides
    (meta,) = run["mirror"].glob("checkpoints/*/meta.json")
    assert json.loads(meta.read_text())["config"]["storage"]["options"][name] == "<redacted>"


@pytest.mark.timeout(240)
def test_a_fresh_mirror_is_filled_from_the_store_before_the_run_is_read(run, store_server, tmp_path: Path):
    """A rerun on another machine (an empty cache) sees the earlier invocation: summary.json's history."""
    cfg = make_config(
        run["url"], "run.name=r", f"storage.cache_dir={tmp_path}", *option_overrides(store_server.options)
    )
    with on_store(cfg, Path(cfg.run_dir), print):
        history = _previous_summaries(Path(cfg.run_dir))
    assert [h["status"] for h in history] == ["completed"] and history[0]["final_step"] == STEPS
