"""jobs/objectstore.py, an S3-compatible store on this machine (issue 43): docs/object-storage.md's commands run as
printed, from its start to its stop: a run trains on the store, the picture is drawn from there, no client says
it found credentials, and the stop ends that store, removes its data and unsets the variables. A stop ends only a
store the job started."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from urllib.parse import urlsplit

import pytest
from conftest import REPO, bash, documented

from distrain.storage.objectstore import Store

sys.path.insert(0, str(REPO / "jobs"))
import objectstore  # noqa: E402  (jobs/objectstore.py)


def variables(output: str) -> dict[str, str]:
    """The AWS_* variables of an `env -0` listing."""
    return {k: v for k, _, v in (kv.partition("=") for kv in output.split("\0")) if k.startswith("AWS_")}


@pytest.mark.timeout(420)
def test_the_documented_commands_run_as_printed(tmp_path):
    if not (REPO / ".venv" / "bin" / "python").exists():
        pytest.skip("the documented commands use the .venv that `make setup` makes")
    start, train, plot, stop = documented("object-storage.md", "On one machine")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RAY_"))}  # a user's shell
    env["DISTRAIN_CACHE_DIR"] = str(tmp_path)  # the run's mirror here, not in ~/.cache
    picture, found = REPO / "plot-first.png", None
    started = bash(f"{start}\nenv -0", env, timeout=120)
    aws = variables(started.stdout)
    try:
        assert started.returncode == 0 and aws["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:"), started.stderr
        found = objectstore.served_at(urlsplit(aws["AWS_ENDPOINT_URL"]).port)
        assert found is not None, "no store serves the endpoint printed"
        trained = bash(train, {**env, **aws}, timeout=300)
        said = trained.stdout + trained.stderr
        assert trained.returncode == 0 and "distrain: completed at step 3" in said, said[-3000:]
        client = {"key": aws["AWS_ACCESS_KEY_ID"], "secret": aws["AWS_SECRET_ACCESS_KEY"]}
        store = Store("s3://runs/team/first", {**client, "endpoint_url": aws["AWS_ENDPOINT_URL"]})
        assert json.loads(store.read_bytes("summary.json"))["final_step"] == 3
        plotted = bash(plot, {**env, **aws}, timeout=120)
        assert plotted.returncode == 0 and plotted.stdout == f"distrain: plotted first to {picture}\n", plotted.stderr
        assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "Found credentials" not in said + plotted.stderr, said[-3000:]
    finally:
        stopped = bash(f"{stop}\nenv -0", {**env, **aws}, timeout=60)
        picture.unlink(missing_ok=True)
        left = found and objectstore.served_at(urlsplit(aws["AWS_ENDPOINT_URL"]).port)
        if left:  # ended by its PID, should the documented stop have failed
            os.killpg(left[0], signal.SIGKILL)
            shutil.rmtree(left[1], ignore_errors=True)
    assert stopped.returncode == 0 and variables(stopped.stdout) == {} and not left, stopped.stderr
    assert not found[1].exists()  # its data removed


def test_stop_ends_only_a_store_that_start_started(s3, monkeypatch, capsys):
    """Not the tests' own store (started elsewhere, its data in no folder of the job's), nor an address where none
    is: one line, exit status 2, the store still serving."""
    for endpoint in (s3.endpoint, "http://127.0.0.1:1"):
        assert objectstore.main(["stop", endpoint]) == 2
        said = capsys.readouterr().err
        assert said == f"distrain: error: {endpoint} is not a store `jobs/objectstore.py start` started\n", said
    assert s3.proc.poll() is None and Store(s3.url("alive")).listing() == {}
    assert objectstore.main(["halt"]) == 2 and capsys.readouterr().err.startswith("usage: jobs/objectstore.py start")
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    assert objectstore.main(["stop"]) == 2 and "no store to stop: give its endpoint" in capsys.readouterr().err
