"""What Ray prints on the driver's console that distrain says itself.

The driver listens to the cluster's error notices: a thread of Ray's prints each as `(raylet) …`, in colour.
When a worker dies, the raylet's is a paragraph on the OOM killer and SIGSEGV; the supervisor sees every
death of the run's workers (an actor's, a task's) and says it in one line, its cause in summary.json. That
notice alone is held back; Ray's other notices, and the workers' own output (log_to_driver, printed by a
handler bound to Ray's printer when ray.init ran), still reach the console."""

from __future__ import annotations

from typing import Any

from ray._private import worker as ray_worker

# How the raylet's notice of a worker's death begins (node_manager.cc, Ray 2.60)
WORKER_DIED = "A worker died or was killed while executing a task by an unexpected system error."


def hide_worker_deaths() -> None:
    """Put the filter in front of the printer Ray's notice listener calls (by its module name, on each notice:
    a notice it is already waiting for is filtered too), before or after ray.init. Once per process."""
    show = getattr(ray_worker, "print_to_stdstream", None)  # a Ray that renamed it: its paragraph shows again
    if show is not None and getattr(show, "hides", None) != WORKER_DIED:
        ray_worker.print_to_stdstream = without_worker_deaths(show)


def without_worker_deaths(show: Any) -> Any:
    """Ray's printer `show`, but for the raylet's notices of a worker's death (each notice is one line)."""

    def print_to_stdstream(data: dict, ignore_prefix: bool) -> None:
        if data.get("pid") != "raylet" or not all(line.startswith(WORKER_DIED) for line in data.get("lines", [])):
            show(data, ignore_prefix)

    print_to_stdstream.hides = WORKER_DIED  # type: ignore[attr-defined]
    return print_to_stdstream
