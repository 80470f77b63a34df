"""The worker actor: one rank, one process, pinned to its placement-group bundle."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

import ray


class Worker:
    """Runs one rank's function. Created with max_concurrency=2: `run` holds one thread for the
    whole training while `progress` answers on the other, so the driver can watch a busy rank."""

    def __init__(self) -> None:
        self._progress: dict = {}

    def node_info(self) -> dict:
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "gpu_ids": [int(g) for g in ray.get_gpu_ids()],
            "pid": os.getpid(),
        }

    def free_port(self) -> int:
        """A port free on this worker's node, for the rendezvous when this worker is rank 0."""
        with socket.socket() as s:
            s.bind((ray.util.get_node_ip_address(), 0))
            return s.getsockname()[1]

    def run(self, fn: Callable[..., Any], env: dict[str, str], *args: Any) -> Any:
        """Call fn(*args, report) with the rank's environment; `report` feeds `progress`."""
        os.environ.update(env)
        return fn(*args, self._report)

    def _report(self, progress: dict) -> None:
        self._progress = {**progress, "time": time.time()}

    def progress(self) -> dict:
        return self._progress


RemoteWorker = ray.remote(Worker)
