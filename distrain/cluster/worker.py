"""The worker actor: one rank, one process, pinned to its placement-group bundle."""

from __future__ import annotations

import fcntl
import gc
import importlib
import os
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import ray

from distrain.channel import Channel, Progress
from distrain.ports import free_port

Fn = Callable[..., Any] | str  # a function, or one named "package.module:function" (`resolve`)


def resolve(fn: Fn) -> Callable[..., Any]:
    """The function itself, or the one `fn` names, its module imported here: the driver hands workers the
    trainer's functions without importing their modules (torch) itself, and each worker imports them as
    its call begins, its environment (threads, visible devices) already set."""
    if not isinstance(fn, str):
        return fn
    module, _, name = fn.partition(":")
    return getattr(importlib.import_module(module), name)


class Worker:
    """Runs one rank's function. Created with max_concurrency=2: `run` holds one thread for the
    whole training while the other answers `progress`, `request_stop` and `stacks`, so the driver
    can watch and steer a busy rank. One actor may run several attempts in turn: a rank whose
    call returned is reused after a failure elsewhere, its imports already warm, and a hot spare
    (`warm`) takes a rank whose worker died."""

    def __init__(self) -> None:
        self.channel = Channel()

    def node_info(self) -> dict:
        ip = ray.util.get_node_ip_address()
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ip,
            "interface": interface_of(ip),
            "gpu_ids": [int(g) for g in ray.get_gpu_ids()],
            "pid": os.getpid(),
        }

    def warm(self, fn: Fn, *args: Any) -> dict:
        """A hot spare's wait: fn(*args) loads what the rank function will need (fn's module: torch
        and the trainer); then where this worker runs."""
        resolve(fn)(*args)
        return self.node_info()

    def free_port(self) -> int:
        """A port free on this worker's node, for the rendezvous when this worker is rank 0."""
        return free_port(ray.util.get_node_ip_address())

    def reset(self) -> None:
        """A fresh channel for the next `run`. A call of its own, answered before `run` is sent:
        `run` may wait seconds for its function to unpickle (importing torch), and a stop request
        that arrives meanwhile must reach the channel that run will read."""
        self.channel = Channel()

    def run(self, fn: Fn, env: dict[str, str], *args: Any) -> Any:
        """Call fn(*args, channel) with the rank's environment. What the process holds before the
        call (its imports: a third of a million objects with torch) is frozen out of the collector's
        sight, so that collecting what the call left behind, before it returns, takes milliseconds
        rather than the quarter of a second a full collection takes: a failed rank's return is on
        the path of every recovery."""
        os.environ.update(env)
        fn = resolve(fn)
        self.channel.report(running_at=time.time())
        gc.freeze()
        try:
            return fn(*args, self.channel)
        finally:
            gc.collect()  # the model the call built, now rather than when the next one starts

    def progress(self) -> Progress:
        return self.channel.progress

    def request_stop(self, deadline: float) -> None:
        self.channel.stop_deadline = deadline

    def stacks(self) -> str:
        """Every thread's Python stack but this one's: where a hung rank is stuck."""
        me = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        parts = [f"pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S')}"]
        for ident, frame in sys._current_frames().items():
            if ident != me:
                stack = "".join(traceback.format_stack(frame))
                parts.append(f"Thread {names.get(ident, ident)}:\n{stack}")
        return "\n".join(parts)

    def call(self, fn: Fn) -> Any:
        """fn() in this process, on the thread `run` leaves free: what the engine hands the group for after
        a failure (a check that the device still works, an abort of the collectives `run` is blocked in)."""
        return resolve(fn)()


SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def interface_of(ip: str) -> str | None:
    """The name of this host's network interface that holds `ip` (IPv4, Linux), or None. The process
    group must use the interface of the address Ray knows the node by: left to itself, gloo binds to
    whatever the host name resolves to, often a loopback address, and interface names differ between
    hosts, so each worker looks its own up."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(answer[20:24]) == ip:
                return name
    return None


RemoteWorker = ray.remote(Worker)
