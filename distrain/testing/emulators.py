"""Google Cloud Storage's and Azure Blob Storage's stand-ins on this machine, for the object-storage tests beside
SeaweedFS (seaweed.py): gcp-storage-emulator (PyPI, the `dev` extra) and Azurite (npm: `make setup` installs it
into .npm/), each bound to one loopback port, its data in a folder of the caller's, ended by its PID. The same
surface as Seaweed's:

    with Azurite(tmp_path) as az:
        az.url("runs")      # az://runs
        az.env              # what a client reads from the environment (here the connection string, its key)
        az.options          # what storage.options must add (gcsfs: token=anon)
        az.secret           # the one secret the client holds, to look for in what a run writes
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from base64 import b64encode
from pathlib import Path

from distrain.ports import free_port
from distrain.testing.processes import LocalServer

BUCKET = "runs"
ROOT = Path(__file__).resolve().parents[2]
AZURITE_VERSION = "3.37.0"  # the Makefile's, which installs it


class Emulator(LocalServer):
    """A server started from `command()` in a session of its own, ready once its port accepts a connection and
    `prepare()` has made the bucket; stopped by its PID (SIGTERM, then SIGKILL)."""

    scheme = ""

    def __init__(self, folder: Path, start_timeout_s: float = 60):
        self.folder, self.start_timeout_s = Path(folder), start_timeout_s
        self.host, self.port = "127.0.0.1", free_port()
        self.proc: subprocess.Popen | None = None

    def url(self, *parts: str) -> str:
        return "/".join([f"{self.scheme}://{BUCKET}", *parts])

    def command(self) -> list[str]:
        raise NotImplementedError

    def server_env(self) -> dict[str, str]:
        return {}

    def prepare(self) -> None:
        """What must exist before a client writes: the bucket."""

    def start(self) -> Emulator:
        command = self.command()  # first: a missing server says so before anything starts
        (self.folder / "data").mkdir(parents=True, exist_ok=True)
        self.log = open(self.folder / "server.log", "ab")  # noqa: SIM115  (closed in stop)
        self.proc = subprocess.Popen(
            command,
            env={**os.environ, **self.server_env()},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self._wait_listening()
            self.prepare()
        except BaseException:
            self.stop()  # also when the wait or the bucket failed: nothing left running
            raise
        return self

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.command()[0]} exited ({self.proc.returncode}): see {self.log.name}")
            try:
                socket.create_connection((self.host, self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    said = f"{self.command()[0]} did not listen within {self.start_timeout_s:g} s"
                    raise RuntimeError(said) from None
                time.sleep(0.1)


class GcsEmulator(Emulator):
    """gcp-storage-emulator: GCS's JSON API, no authentication (gcsfs connects with token=anon) and no
    preconditions: `ifGenerationMatch=0` is ignored, an object written twice is overwritten (objectstore.py's
    create() finds this out and checks instead). It speaks no gRPC: gcsfs's experimental bucket-type lookup
    (a gRPC call, retried for 60 s on every open) is turned off by GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false."""

    scheme = "gs"

    def __init__(self, folder: Path, start_timeout_s: float = 60):
        super().__init__(folder, start_timeout_s)
        # Not a credential of the server's (it takes none): an option the client is given and ignores, so that a
        # run's files can be searched for it as for the other stores' keys.
        self.secret = f"gs-s3cret-{secrets.token_hex(8)}"
        self.options = {"token": "anon"}
        self.secret_options = {**self.options, "secret": self.secret}

    @property
    def env(self) -> dict[str, str]:
        return {
            "STORAGE_EMULATOR_HOST": f"http://{self.host}:{self.port}",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }

    def command(self) -> list[str]:
        binary = Path(sys.executable).parent / "gcp-storage-emulator"
        if not binary.exists():
            raise RuntimeError("no gcp-storage-emulator: pip install -e '.[dev]' (it pins gcp-storage-emulator)")
        where = ["-d", str(self.folder / "data"), "start", "--host", self.host, "--port", str(self.port)]
        return [str(binary), *where, "--default-bucket", BUCKET, "--quiet"]


def azurite_binary() -> str:
    """Azurite's blob server from `make setup`'s .npm/, else one on PATH; RuntimeError saying how to install it."""
    beside = ROOT / ".npm" / "node_modules" / ".bin" / "azurite-blob"
    found = str(beside) if beside.exists() else shutil.which("azurite-blob")
    if found is None:
        raise RuntimeError(
            f"no azurite-blob (Azure's storage emulator, from npm): make setup installs it with npm (Node 20+), or: "
            f"npm install --prefix {ROOT / '.npm'} azurite@{AZURITE_VERSION}"
        )
    return found


class Azurite(Emulator):
    """Azurite's blob service: Shared Key authentication for an account of its own (name and a random key,
    AZURITE_ACCOUNTS, instead of the well-known development key), conditional writes (If-None-Match: *)
    honoured, telemetry off. A client gets the account from AZURE_STORAGE_CONNECTION_STRING, as adlfs reads it."""

    scheme = "az"
    account = "distrain"

    def __init__(self, folder: Path, start_timeout_s: float = 60):
        super().__init__(folder, start_timeout_s)
        self.secret = b64encode(secrets.token_bytes(32)).decode()
        self.options: dict[str, str] = {}
        self.secret_options = {"connection_string": self.connection_string}

    @property
    def connection_string(self) -> str:
        endpoint = f"http://{self.host}:{self.port}/{self.account}"
        account = f"AccountName={self.account};AccountKey={self.secret}"
        return f"DefaultEndpointsProtocol=http;{account};BlobEndpoint={endpoint};"

    @property
    def env(self) -> dict[str, str]:
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string}

    def server_env(self) -> dict[str, str]:
        return {"AZURITE_ACCOUNTS": f"{self.account}:{self.secret}"}

    def command(self) -> list[str]:
        where = ["--blobHost", self.host, "--blobPort", str(self.port), "--location", str(self.folder / "data")]
        return [azurite_binary(), *where, "--silent", "--disableTelemetry", "--skipApiVersionCheck"]

    def prepare(self) -> None:
        from adlfs import AzureBlobFileSystem

        AzureBlobFileSystem(connection_string=self.connection_string, skip_instance_cache=True).mkdir(BUCKET)
