"""A restart while the run's object store is down (issue 46): the driver waits for the store up to
cluster.setup_timeout_s, saying so once, instead of ending the run; past that, one line ends it. A real
S3-compatible store (the `s3` fixture: SeaweedFS on loopback), stopped and started again by its PID."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import time
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import attempt_placement, in_background, logged, make_config
from test_object_storage_ckpt import FAST_OPTIONS, store_config, when

from distrain.driver.launch import train
from distrain.driver.rerun import newest_checkpoint
from distrain.storage.objectstore import StorageError

WAITING = "the restart waits for it (cluster.setup_timeout_s="


@pytest.mark.timeout(240)
def test_a_restart_waits_for_the_store_and_the_run_completes(s3, ray_cluster, tmp_path: Path):
    """The run held before its first step, the store is stopped and rank 1 SIGKILLed. The restart finds the store
    down: one line says it waits (once, over several looks while the store starts again); once it answers, the
    run restarts and completes every step."""
    hold = tmp_path / "hold"
    hold.write_text("")
    cfg = store_config(s3, tmp_path, "waits", "trainer.max_steps=2", f"fault.hold_file={hold}")
    cfg = replace(cfg, storage=replace(cfg.storage, retries=1, backoff_s=0.1, options=FAST_OPTIONS))
    said, killed = io.StringIO(), {}

    def outage() -> None:
        when(lambda: attempt_placement(Path(cfg.run_dir)) is not None)
        (rank_1,) = [e for e in attempt_placement(Path(cfg.run_dir)) if e.get("rank") == 1]
        s3.stop()
        os.kill(rank_1["pid"], signal.SIGKILL)
        killed.update(rank_1)
        when(lambda: WAITING in said.getvalue(), timeout_s=120)
        s3.start()  # seconds: the driver looks again meanwhile (every objectrun.STORE_POLL_S), saying nothing
        hold.unlink()

    helper = in_background(outage)
    try:
        with contextlib.redirect_stdout(said):
            summary = train(cfg)
    finally:
        helper.join(timeout=60)
        hold.unlink(missing_ok=True)
        if s3.proc is None:
            s3.start()
    assert not helper.errors, helper.errors
    lines = said.getvalue().splitlines()
    assert len([line for line in lines if WAITING in line]) == 1, lines
    assert summary["status"] == "completed" and summary["restarts"] == 1
    assert f"pid {killed['pid']}" in summary["attempts"][0]["cause"]
    assert sorted(logged(cfg)) == [1, 2]


def test_a_restart_ends_the_run_in_one_line_when_the_store_stays_down(s3, tmp_path: Path):
    """The store's endpoint refuses every connection for longer than cluster.setup_timeout_s: the restart's look
    for the newest checkpoint says once that it waits, then ends with one line naming the URL, the limit and what to
    do. The driver's own look at the first start (no `say`) does not wait."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: a connection is refused at once
    endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
    cfg = make_config(
        s3.url("down"), "run.name=r", f"storage.cache_dir={tmp_path}", "cluster.setup_timeout_s=3", "storage.retries=0"
    )
    cfg = replace(cfg, storage=replace(cfg.storage, options={**FAST_OPTIONS, "endpoint_url": endpoint}))
    said: list[str] = []
    with closed:
        started = time.monotonic()
        with pytest.raises(StorageError) as ended:
            newest_checkpoint(cfg, tmp_path, said.append)
        waited = time.monotonic() - started
        with pytest.raises(StorageError, match="failed after 1 tries"):
            newest_checkpoint(cfg, tmp_path)
    line = str(ended.value)
    assert "\n" not in line and line.startswith(f"{cfg.run_url} did not answer within cluster.setup_timeout_s=3 s")
    assert "rerun the same command once the store is back" in line
    assert len(said) == 1 and WAITING in said[0], said
    assert 3 <= waited < 30, waited
