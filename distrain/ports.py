"""Ports free on a host right now, for whatever distrain starts that listens: the rendezvous of a process group
(cluster/worker.py), a one-machine Ray head (jobs/cluster.py), the tests' servers and gloo ranks."""

from __future__ import annotations

import contextlib
import socket


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` ports free on `host` now, all different: each socket stays bound until every one is picked (ports
    picked one at a time can repeat, and `ray start` refuses two components on one port)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]
