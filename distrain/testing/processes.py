"""Processes a benchmark starts and must end: commands in sessions of their own, bounded calls, and gloo
ranks on loopback without Ray.

- `run_command()`: a command in its own session, its output to a log, a timeout, and every process it
  leaves behind found by session id and ended by PID, so the next run has the machine to itself.
- `interrupt_after()`: a call in the main thread, stopped (as Ctrl-C would) past its time.
- `spawn_ranks()`: a function in `world` gloo processes on 127.0.0.1, as torchrun would start them.
"""

from __future__ import annotations

import _thread
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Self

from distrain.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
PROG = Path(sys.argv[0]).stem  # the benchmark running, for its console lines


@dataclass
class Finished:
    started: float  # wall clock at launch
    ended: float  # and when the command exited
    rc: int
    log: Path

    def tail(self, lines: int = 30) -> str:
        return "".join(self.log.read_text(errors="replace").splitlines(keepends=True)[-lines:])


class CommandTimeout(RuntimeError):
    pass


def run_command(cmd: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None) -> Finished:
    """Run cmd from the repository root in a session of its own, stdout and stderr to `log`, one torch
    thread per process unless `env` says otherwise; past timeout_s end it (CommandTimeout). Either way,
    wait for the processes it started (a Ray cluster shuts down after its driver) and end by PID any that
    outlive it, so the next run has the machine to itself; if the wait itself is interrupted (Ctrl-C, a
    test's timeout), end them at once."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log, "w") as out:
        started = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop(proc)
        reap(proc.pid)
        tail = Finished(started, time.time(), -1, log).tail()
        raise CommandTimeout(f"{shlex.join(cmd)} ran past {timeout_s:g} s; its log ends:\n{tail}") from None
    except BaseException:
        _stop(proc, grace_s=2)
        reap(proc.pid, grace_s=0)
        raise
    ended = time.time()
    reap(proc.pid)
    return Finished(started, ended, rc, log)


def session(sid: int) -> list[int]:
    """PIDs alive in session `sid`: every process a command started keeps its session (Ray's own processes
    change only their process group), so leftovers are found by id, not by name."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def reap(sid: int, grace_s: float = 20.0) -> None:
    """Wait up to grace_s for session `sid` to end, then SIGTERM what is left, then SIGKILL."""
    for sig, wait_s in ((None, grace_s), (signal.SIGTERM, 5.0 if grace_s else 1.0), (signal.SIGKILL, 5.0)):
        left = session(sid)
        for pid in left if sig else []:
            print(f"{PROG}: process {pid} outlived its command; sending {sig.name}", file=sys.stderr)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.time() + wait_s
        while left and time.time() < deadline:
            time.sleep(0.2)
            left = session(sid)
        if not left:
            return


def _stop(proc: subprocess.Popen, grace_s: float = 15) -> None:
    """End a command that hangs: its process group, terminate, then kill."""
    for sig, grace in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


class LocalServer:
    """A server of the tests' own (`proc`, in a session of its own, writing to `log`), started by the subclass's
    `start`; stopped by its PID (SIGTERM, then SIGKILL), also as a context manager."""

    proc: subprocess.Popen | None = None
    log: IO[bytes] | None = None

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            _stop(self.proc)
        self.proc = None
        if self.log is not None:
            self.log.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def interrupt_after(timeout_s: float, call: Callable[[], Any]) -> tuple[Any, str | None]:
    """call() in the main thread, bounded: past timeout_s it gets a SIGINT (to distrain, a request to stop
    cleanly), 60 s later another (at once). Returns its value and None, or None and what went wrong in one
    line (the traceback goes to the console): one failed run does not end the benchmark."""
    fired, returned = threading.Event(), threading.Event()

    def interrupt() -> None:
        if not returned.is_set():
            fired.set()
            _thread.interrupt_main()

    timers = [threading.Timer(t, interrupt) for t in (timeout_s, timeout_s + 60)]
    for timer in timers:
        timer.start()
    try:
        return call(), None
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt) and not fired.is_set():
            raise  # the user's Ctrl-C
        traceback.print_exc()
        what = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
        return None, f"stopped after {timeout_s:g} s ({what})" if fired.is_set() else what
    finally:
        returned.set()
        for timer in timers:
            timer.cancel()


def join_group(rank: int, world: int, port: int) -> Any:
    """Join a gloo group on loopback as torchrun would set it up, one torch thread per rank; the device."""
    from distrain.parallel import process_group

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.update(MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return process_group.init_from_env()


def spawn_ranks(fn: Callable[..., dict], world: int, *args: Any) -> list[dict]:
    """fn(rank, device, *args) in `world` gloo processes on loopback (no Ray); each rank's returned dict.
    A rank that dies after returning (gloo can abort a process on its way out while one of its threads
    still runs) has done its work: its result is kept, with a warning."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="bench_ranks_") as out:
        files = [Path(out, f"rank{r}.json") for r in range(world)]
        try:
            mp.spawn(_rank, args=(world, free_port(), out, fn, *args), nprocs=world)
        except mp.ProcessExitedException as e:
            if not all(f.exists() for f in files):
                raise
            print(f"{PROG}: {e} after writing its results; keeping them", file=sys.stderr, flush=True)
        return [json.loads(f.read_text()) for f in files]


def _rank(rank: int, world: int, port: int, out: str, fn: Callable[..., dict], *args: Any) -> None:
    from distrain.parallel import process_group

    result = fn(rank, join_group(rank, world, port), *args)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    process_group.destroy()
