"""Recovery after a worker is killed, distrain beside Ray Train:  python jobs/bench_recovery.py

Both systems train the same job on one embedded Ray cluster while a killer thread SIGKILLs a random worker
--kills times: distrain under its supervisor, timed by the supervisor's own record of each attempt
(summary.json → attempts); Ray Train's `TorchTrainer` with `FailureConfig` around distrain's trainer, timed
by rank 0's marks written to a file and by when the old workers' processes exit. What is measured and how
is on the page this writes (docs/recovery.md, its plot beside it).
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import json
import os
import random
import shlex
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench_mfu import compose  # jobs/bench_mfu.py: the config `python jobs/train.py <overrides>` trains
from machine import describe, machine  # jobs/machine.py, beside this script
from svgplot import Canvas  # jobs/svgplot.py, beside this script

from distrain.tracking import read_metrics

ROOT = Path(__file__).resolve().parent.parent
GOAL_S = 10.0  # distrain's median recovery on the embedded cluster
SYSTEMS = {"distrain": "distrain", "raytrain": "Ray Train"}
INTERVAL, FIRST, GAP, TAIL = 5, 12, 10, 5  # a checkpoint every 5 steps; kill i after step FIRST + GAP·(i−1)
TIMEOUT_S = 900.0  # for the kills of one run
MARKS = ("joined_at", "loaded_at", "first_step_at")  # the trainer's own timestamps
PHASES = {  # the table's rows: label, and the colour of the phases both systems have (the plot's segments)
    "detect_teardown": ("detect + tear down", "#d62728"),
    "detection": ("· distrain: detection (kill → failure seen)", None),
    "teardown": ("· distrain: teardown (dead actor released)", None),
    "restart": ("place + start workers + process group", "#ff7f0e"),
    "placement": ("· distrain: placement (replacement up in its bundle)", None),
    "process_group": ("· distrain: process group (→ all ranks joined)", None),
    "load": ("model + checkpoint load", "#1f77b4"),
    "first_step": ("first step", "#2ca02c"),
    "total": ("**total: kill → first step**", None),
    "startup": ("start-up, no kill (call → first step)", None),
}
STACK = {key: v for key, v in PHASES.items() if v[1]}


@dataclass
class Kill:
    number: int
    rank: int
    pid: int
    step: int  # the last step logged before the kill
    at: float  # wall clock, just before the signal
    gone_at: float | None = None  # when the other ranks' processes had all exited
    replaced: int | None = None  # worker processes of the next attempt that were not there before
    phases: dict[str, float] = field(default_factory=dict)  # PHASES keys


@dataclass
class Run:
    system: str
    workers: int
    kills: list[Kill]
    startup_s: float | None  # train() / fit() → first completed step
    load: float  # 1-minute load average when the run began
    error: str | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="2,4", help="comma-separated worker counts, each a run per system")
    p.add_argument("--kills", type=int, default=5, help="SIGKILLs per run (default 5)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {','.join(SYSTEMS)}")
    p.add_argument("--out", default="docs/recovery.md", help="the page, '' for none (its plot: .svg beside it)")
    p.add_argument("--json", default="", help="also write every kill's measurements to this JSON file")
    args = p.parse_args(argv)
    args.workers = [int(n) for n in args.workers.split(",")]
    args.systems = [s for s in args.systems.split(",") if s]
    if not set(args.systems) <= set(SYSTEMS) or args.kills < 1 or min(args.workers) < 2:
        p.error(f"need --systems from {','.join(SYSTEMS)}, --kills ≥ 1 and worker counts ≥ 2")
    return args


def overrides(kills: int, workers: int, storage: Path, name: str) -> list[str]:
    """The Hydra overrides of one run: `python jobs/train.py <these>` trains the same job."""
    return (
        f"model=nano strategy=ddp cluster.num_workers={workers} cluster.use_gpu=false trainer.precision=fp32 "
        f"cluster.max_failures={kills + 1} cluster.restart_backoff_s=0 checkpoint.interval={INTERVAL} "
        f"trainer.max_steps={FIRST + (kills - 1) * GAP + TAIL} trainer.global_batch_size=32 "
        "trainer.micro_batch_size=8 trainer.seq_len=128 trainer.eval_interval=0 trainer.eval_batches=1 "
        f"logger.wandb.mode=disabled run.storage={storage} run.name={name}"
    ).split()


# -- the killer --------------------------------------------------------------------------------------


def logged(run_dir: Path) -> list[dict]:
    """metrics.jsonl as it is now; [] while a line is half-written (the next look has it whole)."""
    with contextlib.suppress(ValueError):
        return read_metrics(str(run_dir))
    return []


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


class Killer(threading.Thread):
    """Kill i comes once an attempt begun after kill i−1 has logged step FIRST + GAP·(i−1), at a
    random moment within the next step, on a random rank (`pids()`: rank → PID of the attempt now).
    Past TIMEOUT_S it interrupts the main thread (to distrain, a request to stop)."""

    def __init__(self, label: str, run_dir: Path, pids: Callable[[], dict[int, int]], count: int):
        super().__init__(daemon=True)
        self.label, self.run_dir, self.pids, self.count = label, run_dir, pids, count
        self.rng, self.kills, self.error = random.Random(label), [], None
        self.done = threading.Event()  # set by the main thread when the run has returned
        self.deadline = time.time() + TIMEOUT_S

    def run(self) -> None:
        after: float | None = 0.0
        try:
            while len(self.kills) < self.count and after is not None:
                after = self.kill(FIRST + len(self.kills) * GAP, after)
        except Exception as e:  # reported with the run
            self.error = f"the killer failed: {e!r}"
        if self.error is None and len(self.kills) < self.count:
            self.error = f"only {len(self.kills)} of {self.count} kills happened"

    def wait(self, ready: Callable[[], object]) -> object | None:
        while not self.done.is_set():
            if value := ready():
                return value
            if time.time() > self.deadline:
                self.error = f"interrupted after {TIMEOUT_S:g} s"
                _thread.interrupt_main()
                return None
            time.sleep(0.02)
        return None

    def kill(self, target: int, after: float) -> float | None:
        """Kill after step `target` (logged later than `after`), then wait for the next attempt's first
        step, noting when the other ranks' processes had all exited; returns when it was logged."""
        line = self.wait(
            lambda: next((r for r in logged(self.run_dir) if r["step"] >= target and r["time"] > after), None)
        )
        if line is None:
            return None
        time.sleep(self.rng.uniform(0.0, line.get("step_time_s", 0.1)))  # anywhere within a step
        pids = self.pids()
        rank = self.rng.randrange(len(pids))
        kill = Kill(len(self.kills) + 1, rank, pids[rank], line["step"], time.time())
        os.kill(kill.pid, signal.SIGKILL)
        self.kills.append(kill)
        print(f"bench_recovery: {self.label}: kill {kill.number}: rank {rank} (pid {kill.pid}) after step {kill.step}")
        old, others = set(pids.values()), [pid for r, pid in pids.items() if r != rank]

        def recovered() -> dict | None:
            if kill.gone_at is None and not any(map(alive, others)):
                kill.gone_at = time.time()
            if set(self.pids().values()) == old:  # the next attempt has not started yet
                return None
            return next((r for r in logged(self.run_dir) if r["time"] > kill.at), None)

        if (first := self.wait(recovered)) is None:
            return None
        kill.replaced = len(set(self.pids().values()) - old)
        print(f"  next step logged {first['time'] - kill.at:.1f} s after the kill (step {first['step']})", flush=True)
        return first["time"]


# -- the two systems ---------------------------------------------------------------------------------


def under_fire(label: str, run_dir: Path, pids: Callable[[], dict[int, int]], kills: int, call: Callable) -> tuple:
    """call() in the main thread (distrain installs its signal handlers there), the killer beside it:
    (the kills, when call() was called, what went wrong or None)."""
    killer, called_at, error = Killer(label, run_dir, pids, kills), time.time(), None
    killer.start()
    try:
        call()
    except KeyboardInterrupt:
        if killer.error is None:  # the user's, not the killer's at TIMEOUT_S
            raise
    except Exception as e:  # WorkerFailure, TrainingFailedError: reported, and the other runs go on
        error = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    finally:
        killer.done.set()
        killer.join(timeout=10)
    return killer.kills, called_at, error or killer.error


def run_distrain(kills: int, workers: int, storage: Path) -> Run:
    """distrain.launch.train; its phases from the supervisor's record of the attempt after each kill."""
    from distrain.launch import train

    cfg = compose(overrides(kills, workers, storage, f"distrain-{workers}w"))
    run_dir, load = Path(cfg.run_dir), os.getloadavg()[0]

    def pids() -> dict[int, int]:  # placement.json: the current attempt's, rewritten before it starts
        with contextlib.suppress(FileNotFoundError, ValueError):
            return {e["rank"]: e["pid"] for e in json.loads((run_dir / "placement.json").read_text())}
        return {}

    done, called_at, error = under_fire(f"distrain, {workers} workers", run_dir, pids, kills, lambda: train(cfg))
    attempts = json.loads((run_dir / "summary.json").read_text())["attempts"]
    for kill in done:
        attempt = next((a for a in attempts if a["timings"]["since"] >= kill.at), {"timings": {}})
        t, r = attempt["timings"], attempt.get("recovery", {})
        if "first_step_at" not in t:
            continue
        if f"pid {kill.pid} " not in (cause := attempts[attempt["number"] - 2].get("cause") or ""):
            print(f"bench_recovery: warning: kill {kill.number} (pid {kill.pid}) was followed by: {cause}")
        p = kill.phases = {
            "detection": t["since"] - kill.at,
            "teardown": r["teardown_s"],
            "placement": r["placement_s"],
            "process_group": r["process_group_s"],
            "load": r["checkpoint_load_s"],
            "first_step": r["first_step_s"],
            "total": t["first_step_at"] - kill.at,
        }
        p |= {"detect_teardown": p["detection"] + p["teardown"], "restart": p["placement"] + p["process_group"]}
    first = attempts[0]["timings"].get("first_step_at")
    return Run("distrain", workers, done, first and first - called_at, load, error)


class Recorder:
    """The trainer's channel under Ray Train: writes this rank's PID (for the killer) to
    <run_dir>/pids/<rank>, and appends rank 0's marks, with when its train loop was entered, to
    <run_dir>/marks.jsonl (each line all of that attempt's marks so far)."""

    stop_deadline = None  # Ray Train asks for no stop

    def __init__(self, run_dir: Path, rank: int):
        self.record, self.marks = {"entered_at": time.time()}, run_dir / "marks.jsonl" if rank == 0 else None
        (run_dir / "pids").mkdir(exist_ok=True)
        tmp = run_dir / "pids" / f".{rank}.{os.getpid()}"
        tmp.write_text(str(os.getpid()))
        tmp.replace(run_dir / "pids" / str(rank))  # atomic: the killer never reads half a file

    def report(self, progress: dict) -> None:
        if self.marks and any(k in progress for k in MARKS):
            self.record |= {k: progress[k] for k in MARKS if k in progress}
            with open(self.marks, "a") as f:
                f.write(json.dumps(self.record) + "\n")


def raytrain_loop(job: dict) -> None:
    """One Ray Train worker: distrain's trainer in the process group Ray Train formed (init_from_env
    leaves it alone), resuming, like an attempt under distrain, from the newest committed checkpoint."""
    import torch.distributed as dist

    from distrain import checkpoint
    from distrain.train.loop import run_rank

    run_dir = Path(job["run_dir"])
    latest = checkpoint.latest(run_dir / "checkpoints")
    run_rank({**job, "resume_from": str(latest) if latest else None}, Recorder(run_dir, dist.get_rank()))


def run_raytrain(kills: int, workers: int, storage: Path) -> Run:
    """TorchTrainer on the same config, CPU share and threads per worker; gloo on loopback. Detection +
    teardown end when the other ranks' processes have exited, the restart when rank 0 has joined."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from distrain.config import to_plain

    cfg = compose(overrides(kills, workers, storage, f"raytrain-{workers}w"))
    run_dir, load = Path(cfg.run_dir), os.getloadavg()[0]
    run_dir.mkdir(parents=True)
    job = {"config": to_plain(cfg), "run_dir": str(run_dir), "wandb_run_id": None, "started_at": time.time()}
    cpus, threads = cfg.cluster.cpus_per_worker, cfg.cluster.threads_per_worker
    env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": str(threads)}
    trainer = TorchTrainer(
        raytrain_loop,
        train_loop_config=job,
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False, resources_per_worker={"CPU": cpus}),
        run_config=RunConfig(
            name=f"raytrain-{workers}w",
            storage_path=str(storage / "ray_train"),
            failure_config=FailureConfig(max_failures=kills + 1),
            worker_runtime_env={"env_vars": env},
        ),
    )

    def pids() -> dict[int, int]:  # written by each rank's Recorder, the old attempt's until overwritten
        found = {int(p.name): int(p.read_text()) for p in (run_dir / "pids").glob("[0-9]*")}
        return found if len(found) == workers else {}

    done, called_at, error = under_fire(f"Ray Train, {workers} workers", run_dir, pids, kills, trainer.fit)
    lines = (run_dir / "marks.jsonl").read_text().splitlines() if (run_dir / "marks.jsonl").exists() else []
    by_entry = {m["entered_at"]: m for m in map(json.loads, lines)}  # the last, fullest line of each attempt
    marks = [by_entry[k] for k in sorted(by_entry)]
    for kill in done:
        m = next((m for m in marks if m["entered_at"] > kill.at), {})
        if "first_step_at" in m and kill.gone_at:
            kill.phases = {
                "detect_teardown": kill.gone_at - kill.at,
                "restart": m["joined_at"] - kill.gone_at,
                "load": m["loaded_at"] - m["joined_at"],
                "first_step": m["first_step_at"] - m["loaded_at"],
                "total": m["first_step_at"] - kill.at,
            }
    startup = marks[0]["first_step_at"] - called_at if marks and "first_step_at" in marks[0] else None
    return Run("raytrain", workers, done, startup, load, error)


# -- the page ----------------------------------------------------------------------------------------


def stats(run: Run, key: str) -> tuple[float, float, float] | None:
    """(median, min, max) over the kills of a PHASES key ("startup": the one start-up); None if not measured."""
    if key == "startup":
        return (run.startup_s,) * 3 if run.startup_s else None
    have = [k.phases[key] for k in run.kills if key in k.phases]
    return (statistics.median(have), min(have), max(have)) if have else None


def median(run: Run, key: str) -> float:
    return s[0] if (s := stats(run, key)) else 0.0


def pairs(runs: list[Run]) -> dict[int, dict[str, Run]]:
    """worker count → system → run, for the counts both systems ran."""
    by = {n: {r.system: r for r in runs if r.workers == n} for n in sorted({r.workers for r in runs})}
    return {n: pair for n, pair in by.items() if len(pair) == 2}


def cell(s: tuple[float, float, float] | None) -> str:
    return "—" if s is None else f"{s[0]:.2f}" + (f" ({s[1]:.2f}–{s[2]:.2f})" if s[1] < s[2] else "")


def table(runs: list[Run]) -> list[str]:
    """A row per phase, a column per run, then Ray Train's median over distrain's per worker count."""
    both = pairs(runs)
    head = [f"{SYSTEMS[r.system]}, {r.workers} workers" for r in runs]
    head += [f"Ray Train / distrain, {n} workers" for n in both]
    rows = ["| median s (min–max) | " + " | ".join(head) + " |", "| --- |" + " ---: |" * len(head)]
    for key, (label, _) in PHASES.items():
        ratios = [(median(p["raytrain"], key), median(p["distrain"], key)) for p in both.values()]
        cells = [cell(stats(r, key)) for r in runs] + [f"{t / d:.1f}×" if t and d else "—" for t, d in ratios]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return rows


def kill_rows(runs: list[Run]) -> list[str]:
    head = ["run", "kill", "rank", "after step", "workers replaced", *(name for name, _ in STACK.values()), "total"]
    rows = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for r in runs:
        for k in r.kills:
            values = [f"{k.phases[key]:.2f}" if key in k.phases else "—" for key in [*STACK, "total"]]
            cells = [f"{SYSTEMS[r.system]}, {r.workers} workers", k.number, k.rank, k.step, k.replaced, *values]
            rows.append("| " + " | ".join(map(str, cells)) + " |")
    return rows


def svg(runs: list[Run]) -> str:
    """A bar per run, stacked from the median of each phase, the goal marked."""
    left, top = 160, 44
    longest = max([GOAL_S, *(sum(median(r, key) for key in STACK) for r in runs)])
    scale, axis = 560 / longest, top + len(runs) * 38
    canvas = Canvas(800, axis + 60)
    canvas.text(left, 20, "Recovery after a SIGKILL: median s per phase", font_size=14)
    for i, r in enumerate(runs):
        y, x = top + i * 38, float(left)
        canvas.text(left - 8, y + 17, f"{SYSTEMS[r.system]}, {r.workers} workers", "end")
        for key, (name, colour) in STACK.items():
            m = median(r, key)
            canvas.add("rect", f"<title>{name}: {m:.2f} s</title>", x=x, y=y, width=m * scale, height=26, fill=colour)
            x += m * scale
        canvas.text(x + 6, y + 17, f"{median(r, 'total'):.1f} s")
    for t in range(0, int(longest) + 1, 5 if longest > 12 else 1):
        canvas.text(left + t * scale, axis + 12, str(t), "middle")
    g = left + GOAL_S * scale
    canvas.line(g, top - 6, g, axis, "#555", dash="4 3")
    canvas.text(g + 4, top - 8, f"goal {GOAL_S:g} s", fill="#555")
    canvas.legend([(name, colour, None) for name, colour in STACK.values()], 20, axis + 40, across=True, box=True)
    return canvas.render()


def reading(runs: list[Run]) -> str:
    """What the numbers say, from the numbers."""
    lines = []
    for n, pair in pairs(runs).items():
        d = {key: median(pair["distrain"], key) for key in PHASES}
        t = {key: median(pair["raytrain"], key) for key in PHASES}
        if d["total"] and t["total"]:
            lines.append(
                f"- **{n} workers.** distrain recovers in a median {d['total']:.1f} s "
                f"({'under' if d['total'] < GOAL_S else 'over'} the {GOAL_S:g} s goal): detection "
                f"{d['detection']:.2f} s, teardown {d['teardown']:.2f} s, placement {d['placement']:.2f} s, process "
                f"group {d['process_group']:.2f} s. Ray Train takes {t['total']:.1f} s, {t['total'] / d['total']:.1f}× "
                f"as long: {t['detect_teardown']:.1f} s until its old workers are gone, {t['restart']:.1f} s more "
                "until its new group has formed the process group."
            )
    return "".join(line + "\n" for line in lines)


def markdown(kills: int, workers: list[int], command: str, info: dict, runs: list[Run], plot: str) -> str:
    from distrain.model.size import num_params

    cfg = compose(overrides(kills, workers[0], Path(tempfile.gettempdir()), "plan"))
    cpus, threads, params = cfg.cluster.cpus_per_worker, cfg.cluster.threads_per_worker, num_params(cfg.model) / 1e6
    loads = "".join(f", before {SYSTEMS[r.system]} on {r.workers} workers {r.load:.2f}" for r in runs)
    failed = "".join(f"- {SYSTEMS[r.system]}, {r.workers} workers: {r.error}\n" for r in runs if r.error)
    nl = "\n"
    return f"""# Recovery after a worker is killed: distrain vs Ray Train

`jobs/bench_recovery.py` trains the same job under distrain's supervisor and under Ray Train's `TorchTrainer` with
`FailureConfig`, one after the other on one embedded Ray cluster (loopback only), and SIGKILLs a random worker
process {kills} time(s) during each run. Recovery is the time from the kill to the first completed training step
after it. Under Ray Train the train loop is distrain's own trainer (`distrain.train.loop.run_rank`) on the same
config, in the gloo process group Ray Train forms, resuming from the same checkpoints on the same disk: model,
data, checkpoint format and step are identical, so **the comparison is of the orchestration alone**.

```bash
{command}
```

- Machine: {describe(info)}; 1-minute load average at the start {info["load"]:.2f}{loads} (other work on the
  machine shares the cores and shows up as slower phases).
- Job: `model=nano` ({params:.2f} M parameters), DDP on {" and ".join(map(str, workers))} CPU workers ({cpus:g} CPU
  and {threads} torch thread each, gloo), global batch 32 × 128 tokens, micro-batch 8, fp32, {cfg.trainer.max_steps}
  steps, a checkpoint every {INTERVAL} steps; kill i comes after step {FIRST} + {GAP}·(i−1), at a random moment
  within the next step, on a random rank. distrain: `cluster.max_failures={kills + 1} cluster.restart_backoff_s=0`;
  Ray Train: `FailureConfig(max_failures={kills + 1})`, `ScalingConfig(use_gpu=False, resources_per_worker={{'CPU':
  {cpus:g}}})`, its defaults otherwise (a health check every 2 s).
- How each phase is timed (wall clock). distrain: from the supervisor's record of the attempt after the kill
  (`summary.json` → `attempts`): detection = `since` (the failure seen) − kill; teardown, placement, process
  group, model + checkpoint load and first step = its `recovery` phases, between `since`, `torn_down_at`,
  `placed_at` and rank 0's `joined_at`, `loaded_at`, `first_step_at`; total = `first_step_at` − kill. Ray Train
  keeps no such record: rank 0's trainer writes the same marks to a file; detection + teardown = kill → the other
  ranks' processes have all exited (polled in `/proc` every 20 ms), then → rank 0 joined in the new process group.
- The cluster runs the dashboard on 127.0.0.1 (`RAY_API_SERVER_ADDRESS` names it to every worker): Ray Train's
  placement-group cleaner asks the state API whether its controller lives, and without a dashboard it goes
  looking for any other Ray cluster on the machine.

## Side by side

{nl.join(table(runs))}

![median phases of each run]({plot})

## Reading

{reading(runs)}- distrain's recovery is short because little has to happen: the supervisor waits on the ranks'
  calls with `ray.wait`, so a death is seen at once; the healthy actors are kept, torch and the trainer already
  imported; only the dead one is replaced, in the bundle it held. Most of what is left is the replacement's
  start: a Python process that imports Ray (placement), then torch and the trainer before it joins.
- Ray Train sees the death at its controller's next poll (at most 2 s later), shuts the whole worker group down
  and starts a new one: a placement group and processes that each import torch and the trainer. On a small
  machine those imports compete for the cores, so the more workers, the longer; about a fresh start's time.
- Load and first step are the same code in both. GPU recovery (NCCL, CUDA contexts, larger checkpoints) is not
  measured here: this is the CPU/gloo path on one machine.
{f"{nl}Problems during the runs:{nl}{nl}{failed}" if failed else ""}
## Every kill

{nl.join(kill_rows(runs))}
"""


def start_cluster() -> None:
    """One embedded cluster for every run, with the dashboard on 127.0.0.1 (see the page's note on it):
    RAY_API_SERVER_ADDRESS, inherited by every worker, names it to Ray Train's placement-group cleaner."""
    import ray

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
    ray.init(address="local", include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=port)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    exe = os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT)) else sys.executable
    command = shlex.join([exe, "jobs/bench_recovery.py", *(sys.argv[1:] if argv is None else argv)])
    os.environ.pop("RAY_ADDRESS", None)  # the killer signals worker PIDs: the cluster must be this machine's
    # Loopback only: Ray reads this when it is first imported (see jobs/bench_collectives.py).
    os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    info = machine()
    if "raytrain" in args.systems:
        import ray.train.torch  # noqa: F401  (now, not after distrain's runs; the extra: pip install -e ".[bench]")
    import ray

    storage, runs = Path(tempfile.mkdtemp(prefix="bench_recovery_")), []
    try:
        start_cluster()
        for workers in args.workers:
            for system in args.systems:
                print(f"bench_recovery: {SYSTEMS[system]}, {workers} workers, {args.kills} kill(s) ...", flush=True)
                runs.append((run_distrain if system == "distrain" else run_raytrain)(args.kills, workers, storage))
                print("\n".join(table(runs[-1:])) + (f"\nproblem: {runs[-1].error}" if runs[-1].error else ""))
    finally:
        ray.shutdown()
        shutil.rmtree(storage, ignore_errors=True)
    print("\n" + "\n".join(table(runs)))
    if args.out:
        out = ROOT / args.out
        out.with_suffix(".svg").write_text(svg(runs))
        out.write_text(markdown(args.kills, args.workers, command, info, runs, out.with_suffix(".svg").name))
        print(f"wrote {out} and {out.with_suffix('.svg')}")
    if args.json:
        record = {"machine": info, "command": command, "runs": [asdict(r) for r in runs]}
        Path(args.json).write_text(json.dumps(record, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
