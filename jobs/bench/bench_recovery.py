"""Recovery after a kill: distrain from replicas or from checkpoint, Ray Train:  python jobs/bench/bench_recovery.py

The same job trains on one embedded Ray cluster while a killer thread SIGKILLs a random worker: under
distrain's supervisor with one hot spare, recovering from the live replicas' memory (`replicas`, the
default) or from the last checkpoint (`checkpoint`: `cluster.peer_recovery=false`), timed by the supervisor's
own record of each attempt (summary.json → attempts, which also gives the steps redone); and under Ray
Train's `TorchTrainer` with `FailureConfig` around distrain's trainer, timed by rank 0's marks written to a
file and by when the old workers' processes exit. Every configuration runs --repeats times on each worker
count, the order reversed on every other repeat. `--efficiency S` adds runs of S seconds with a kill every
30 s (recovery_efficiency.py). What is measured and how is on the page this writes (docs/recovery.md, its
plot beside it, and the plot's numbers: `--replot docs/recovery.json` redraws it).
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import harness  # first: it keeps Ray on loopback
import recovery_efficiency
from plots import figure  # jobs/bench/plots.py, beside this script
from recovery_job import FIRST, GAP, INTERVAL, logged, overrides, redone

from distrain.testing import processes

GOAL_S = 1.0  # kill → next step from the replicas, 4 workers; and only the step in flight redone
SYSTEMS = {  # each distrain system has one hot spare; they differ in the way back only
    "replicas": "distrain, from replicas",
    "checkpoint": "distrain, from checkpoint",
    "raytrain": "Ray Train",
}
SPARE_WAIT_S = 120.0  # the longest the killer holds a run for its spares to be warm; then it kills anyway
MARKS = ("joined_at", "loaded_at", "first_step_at")  # the trainer's own timestamps
PHASES = {  # the table's rows: label, and the colour of the phases all systems have (the plot's segments)
    "detect_teardown": ("detect + tear down", "#d62728"),
    "detection": ("· distrain: detection (kill → failure seen)", None),
    "teardown": ("· distrain: teardown (dead actor released)", None),
    "restart": ("place + start workers + process group", "#ff7f0e"),
    "placement": ("· distrain: placement (a spare, or a new actor, in the bundle)", None),
    "process_group": ("· distrain: process group (→ all ranks joined)", None),
    "load": ("model + state load (checkpoint, or a replica's)", "#1f77b4"),
    "first_step": ("first step", "#2ca02c"),
    "total": ("**total: kill → first step**", None),
    "startup": ("start-up, no kill (call → first step)", None),
    "redone": ("**steps redone per failure**", None),
}
STACK = {key: v for key, v in PHASES.items() if v[1]}
COUNTS = ("redone",)  # PHASES keys that count steps, not seconds


@dataclass
class Kill:
    number: int
    rank: int
    pid: int
    step: int  # the last step logged before the kill
    at: float  # wall clock, just before the signal
    spares_warm: int = 0  # warm hot spares when the kill came
    gone_at: float | None = None  # when the other ranks' processes had all exited
    took_spare: bool | None = None  # whether a warm spare took the dead rank (None: no spare there)
    phases: dict[str, float] = field(default_factory=dict)  # PHASES keys
    redone: int | None = None  # steps done twice: the step in flight, and any since the state resumed from
    last_step: int | None = None  # the highest step logged when the kill came
    next_step: int | None = None  # the first step logged after it


@dataclass
class Run:
    system: str
    workers: int
    repeat: int
    kills: list[Kill]
    startup_s: float | None  # train() / fit() → first completed step
    error: str | None = None


def parse_args(argv: list[str] | None = None):
    p = harness.parser(__doc__, "docs/recovery.md", repeats=3, plot=True, cluster=True)
    p.add_argument("--workers", help="comma-separated worker counts, each a run per system (default 2,4; smoke 2)")
    p.add_argument("--kills", type=int, default=1, help="SIGKILLs per run (default 1)")
    p.add_argument("--systems", help=f"a subset of {','.join(SYSTEMS)} (default all; smoke replicas)")
    p.add_argument("--timeout", type=float, default=900, help="seconds a run may take before it is stopped")
    p.add_argument("--json", default="", help="also write every kill's measurements to this JSON file")
    p.add_argument("--efficiency", type=float, default=0.0, help="also run windows of this many seconds")
    args = harness.parse(p, argv)
    args.workers = args.workers or ("2" if args.smoke else "2,4")
    args.systems = args.systems or ("replicas" if args.smoke else ",".join(SYSTEMS))
    args.workers = [int(n) for n in args.workers.split(",")]
    args.systems = [s for s in args.systems.split(",") if s]
    if not set(args.systems) <= set(SYSTEMS) or args.kills < 1 or min(args.workers) < 2 or args.efficiency < 0:
        p.error(f"need --systems from {','.join(SYSTEMS)}, --kills ≥ 1, worker counts ≥ 2, --efficiency ≥ 0")
    return args


# -- the killer --------------------------------------------------------------------------------------


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


class Killer(threading.Thread):
    """Kill i comes once an attempt begun after kill i−1 has logged step FIRST + GAP·(i−1): the run is held
    before its next step (fault.hold_file) until `spares` hot spares are warm, then let go and a random rank
    (`pids()`: rank → PID of the attempt now) is killed at a random moment within that step."""

    def __init__(self, label: str, run_dir: Path, pids: Callable[[], dict[int, int]], count: int, spares: int):
        super().__init__(daemon=True)
        self.label, self.run_dir, self.pids, self.count, self.spares = label, run_dir, pids, count, spares
        self.placement = run_dir / "placement.json"  # distrain lists its warm spares there
        self.hold = Path(f"{run_dir}.hold")
        self.rng, self.kills, self.error = random.Random(label), [], None
        self.done = threading.Event()  # set by the main thread when the run has returned

    def run(self) -> None:
        after: float | None = 0.0
        try:
            while len(self.kills) < self.count and after is not None:
                after = self.kill(FIRST + len(self.kills) * GAP, after)
        except Exception as e:  # reported with the run
            self.error = f"the killer failed: {e!r}"
        finally:
            self.hold.unlink(missing_ok=True)
        if self.error is None and len(self.kills) < self.count:
            self.error = f"only {len(self.kills)} of {self.count} kills happened"

    def warm(self) -> set[int]:
        """The PIDs of the hot spares that are warm now."""
        return {e["pid"] for e in harness.read_json(self.placement, []) if "spare" in e} if self.spares else set()

    def wait(self, ready: Callable[[], object]) -> object | None:
        while not self.done.is_set():
            if value := ready():
                return value
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
        self.hold.touch()
        pids, deadline = self.pids(), time.time() + SPARE_WAIT_S
        ready = self.wait(lambda: self.spares == 0 or time.time() > deadline or len(self.warm()) >= self.spares)
        warm = self.warm()
        self.hold.unlink()
        if ready is None:
            return None
        time.sleep(self.rng.uniform(0.0, line.get("step_time_s", 0.1)))  # anywhere within the next step
        rank = self.rng.randrange(len(pids))
        kill = Kill(len(self.kills) + 1, rank, pids[rank], line["step"], time.time(), len(warm))
        os.kill(kill.pid, signal.SIGKILL)
        kill.last_step = max((r["step"] for r in logged(self.run_dir)), default=None)
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
        kill.took_spare = bool(set(self.pids().values()) & warm) if self.spares else None
        kill.next_step = first["step"]
        print(f"  next step logged {first['time'] - kill.at:.1f} s after the kill (step {first['step']})", flush=True)
        return first["time"]


def under_fire(label: str, run_dir: Path, pids: Callable, args, spares: int, call: Callable) -> tuple:
    """call() in the main thread (distrain installs its signal handlers there), bounded by --timeout, the
    killer beside it: (the kills, when call() was called, what went wrong or None)."""
    killer, called_at = Killer(label, run_dir, pids, args.kills, spares), time.time()
    killer.start()
    try:
        _, error = processes.interrupt_after(args.timeout, call)
    finally:
        killer.done.set()
        killer.join(timeout=10)
    return killer.kills, called_at, error or killer.error


# -- the three systems -------------------------------------------------------------------------------


def run_distrain(system: str, workers: int, repeat: int, args, storage: Path) -> Run:
    """distrain.driver.launch.train; its phases from the supervisor's record of the attempt after each kill."""
    from distrain.driver.cli import compose
    from distrain.driver.launch import train

    cfg = compose(overrides(args, system, workers, storage, f"{system}-{workers}w-{repeat}"))
    run_dir = Path(cfg.run_dir)

    def pids() -> dict[int, int]:  # placement.json: the current attempt's ranks (and warm spares), rewritten
        placement = harness.read_json(run_dir / "placement.json", [])
        return {e["rank"]: e["pid"] for e in placement if "rank" in e}

    label, spares = f"{SYSTEMS[system]}, {workers} workers", cfg.cluster.spares
    done, called_at, error = under_fire(label, run_dir, pids, args, spares, lambda: train(cfg))
    if off := harness.off_loopback(harness.read_json(run_dir / "placement.json", [])):
        error = f"ran off loopback: {off}"
    attempts = harness.read_json(run_dir / "summary.json", {}).get("attempts", [])
    for kill in done:
        attempt = next((a for a in attempts if a["timings"]["since"] >= kill.at), {"timings": {}})
        t, r = attempt["timings"], attempt.get("recovery", {})
        if "first_step_at" not in t:
            continue
        if f"pid {kill.pid} " not in (cause := attempts[attempt["number"] - 2].get("cause") or ""):
            print(f"bench_recovery: warning: kill {kill.number} (pid {kill.pid}) was followed by: {cause}")
        kill.redone = redone(attempts[attempt["number"] - 2], attempt)
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
    first = attempts[0]["timings"].get("first_step_at") if attempts else None
    return Run(system, workers, repeat, done, first and first - called_at, error)


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

    def report(self, **progress: object) -> None:
        if self.marks and any(k in progress for k in MARKS):
            self.record |= {k: progress[k] for k in MARKS if k in progress}
            with open(self.marks, "a") as f:
                f.write(json.dumps(self.record) + "\n")


def raytrain_loop(config: dict) -> None:
    """One Ray Train worker: distrain's trainer in the process group Ray Train formed (init_from_env
    leaves it alone), resuming, like an attempt under distrain, from the newest committed checkpoint."""
    from dataclasses import replace

    import torch.distributed as dist

    from distrain.storage import checkpoint
    from distrain.train.job import FRESH, FromCheckpoint
    from distrain.train.rank import run_rank

    job = config["job"]
    run_dir = Path(job.run_dir)
    latest = checkpoint.latest(run_dir / "checkpoints")
    run_rank(replace(job, start=FromCheckpoint(str(latest)) if latest else FRESH), Recorder(run_dir, dist.get_rank()))


def run_raytrain(system: str, workers: int, repeat: int, args, storage: Path) -> Run:
    """TorchTrainer on the same config, CPU share and threads per worker; gloo on loopback. Detection +
    teardown end when the other ranks' processes have exited, the restart when rank 0 has joined."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from distrain.driver.cli import compose
    from distrain.driver.validation import validate
    from distrain.train.job import RankJob

    name = f"raytrain-{workers}w-{repeat}"
    cfg = compose(overrides(args, system, workers, storage, name))
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True)
    job = RankJob(cfg, validate(cfg), str(run_dir), time.time())
    cpus, threads = cfg.cluster.cpus_per_worker, cfg.cluster.threads_per_worker
    env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": str(threads)}
    trainer = TorchTrainer(
        raytrain_loop,
        train_loop_config={"job": job},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False, resources_per_worker={"CPU": cpus}),
        run_config=RunConfig(
            name=name,
            storage_path=str(storage / "ray_train"),
            failure_config=FailureConfig(max_failures=args.kills + 1),
            worker_runtime_env={"env_vars": env},
        ),
    )

    def pids() -> dict[int, int]:  # written by each rank's Recorder, the old attempt's until overwritten
        found = {int(p.name): int(p.read_text()) for p in (run_dir / "pids").glob("[0-9]*")}
        return found if len(found) == workers else {}

    done, called_at, error = under_fire(f"Ray Train, {workers} workers", run_dir, pids, args, 0, trainer.fit)
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
    for kill in done:  # no record of a step begun: those logged before the kill and again after, and the one in
        if kill.last_step is not None and kill.next_step is not None:  # flight (seen by the killer: a resumed
            kill.redone = kill.last_step - kill.next_step + 2  # trainer trims metrics.jsonl to its step)
    startup = marks[0]["first_step_at"] - called_at if marks and "first_step_at" in marks[0] else None
    return Run(system, workers, repeat, done, startup, error)


# -- the page ----------------------------------------------------------------------------------------


def values(trials: list[harness.Trial], key: str) -> list[float]:
    """A PHASES key over the kills of some runs ("startup": each run's one start-up; "redone": the steps
    each kill cost twice)."""
    if key == "startup":
        return [t.result.startup_s for t in trials if t.result.startup_s]
    if key == "redone":
        return [k.redone for t in trials for k in t.result.kills if k.redone is not None]
    return [k.phases[key] for t in trials for k in t.result.kills if key in k.phases]


def median(trials: list[harness.Trial], key: str) -> float:
    return harness.median_of(values(trials, key)) or 0.0


def configs(trials: list[harness.Trial]) -> dict[int, dict[str, list[harness.Trial]]]:
    """worker count → system → its runs."""
    out: dict[int, dict[str, list[harness.Trial]]] = {}
    for (system, workers), mine in sorted(harness.by_key(trials).items(), key=lambda kv: kv[0][1]):
        out.setdefault(workers, {})[system] = mine
    return {n: {s: by[s] for s in SYSTEMS if s in by} for n, by in out.items()}


def tables(trials: list[harness.Trial]) -> list[str]:
    """Per worker count: a row per phase, a column per system (median over every kill of its runs, min–max),
    then Ray Train's median over distrain-from-replicas'."""
    lines = []
    for n, by in configs(trials).items():
        ratio = "raytrain" in by and "replicas" in by
        head = ["median s (min–max)", *(SYSTEMS[s] for s in by)] + ["Ray Train ÷ distrain from replicas"] * ratio
        rows = []
        for key, (label, _) in PHASES.items():
            cells = [harness.spread(values(mine, key), "g" if key in COUNTS else ".2f") for mine in by.values()]
            if ratio:
                t, d = median(by["raytrain"], key), median(by["replicas"], key)
                cells.append(f"{t / d:.1f}×" if t and d else "—")
            rows.append([label, *cells])
        kills = {s: sum(len(t.result.kills) for t in mine) for s, mine in by.items()}
        rows.append(["kills (runs)", *(f"{kills[s]} ({len(mine)})" for s, mine in by.items()), *[""] * ratio])
        lines += [f"### {n} workers", "", *harness.table(head, rows), ""]
    return lines


def kill_rows(trials: list[harness.Trial]) -> list[str]:
    head = ["run", "repeat", "load before", "kill", "rank", "after step", "spare took it"]
    head += [*(name for name, _ in STACK.values()), "total", "steps redone"]
    rows = []
    for t in sorted(trials, key=lambda t: (t.result.workers, list(SYSTEMS).index(t.result.system), t.repeat)):
        r = t.result
        for k in r.kills:
            spare = "—" if k.took_spare is None else ("yes" if k.took_spare else f"no ({k.spares_warm} warm)")
            cells = [f"{SYSTEMS[r.system]}, {r.workers} workers", r.repeat, f"{t.load:.2f}", k.number, k.rank]
            cells += [k.step, spare, *(f"{k.phases[key]:.2f}" if key in k.phases else "—" for key in [*STACK, "total"])]
            cells.append("—" if k.redone is None else k.redone)
            rows.append(cells)
        if r.error:
            rows.append([f"{SYSTEMS[r.system]}, {r.workers} workers", r.repeat, f"{t.load:.2f}", f"problem: {r.error}"])
            rows[-1] += [""] * (len(head) - len(rows[-1]))
    return harness.table(head, rows, "lrrrrrl" + "r" * (len(STACK) + 2))


def plot_data(trials: list[harness.Trial]) -> dict:
    """What the plot shows: a bar per configuration, the median of each phase and of the total."""
    bars = [
        {"label": f"{SYSTEMS[s]}, {n} workers", **{key: median(mine, key) for key in [*STACK, "total"]}}
        for n, by in configs(trials).items()
        for s, mine in by.items()
    ]
    return {"goal_s": GOAL_S, "bars": bars}


def draw(data: dict):  # noqa: ANN201  (a matplotlib Figure)
    """A bar per configuration, stacked from the median of each phase, the goal marked."""
    bars, goal = data["bars"], data["goal_s"]
    fig, ax = figure(8.0, 1.4 + 0.4 * len(bars))
    labels = [b["label"] for b in bars]
    left = [0.0] * len(bars)
    for key, (name, colour) in STACK.items():
        widths = [b[key] for b in bars]
        ax.barh(labels, widths, left=left, color=colour, label=name)
        left = [a + w for a, w in zip(left, widths, strict=True)]
    for y, b in enumerate(bars):
        ax.annotate(f"{b['total']:.1f} s", (left[y], y), xytext=(4, 0), textcoords="offset points", va="center")
    ax.axvline(goal, color="#555", linestyle="--", linewidth=1)
    ax.annotate(f"goal {goal:g} s from replicas", (goal, 1), xycoords=("data", "axes fraction"),
                xytext=(4, 2), textcoords="offset points", color="#555")  # fmt: skip
    ax.invert_yaxis()
    ax.grid(axis="y", visible=False)
    ax.set_xlabel("seconds")
    ax.set_title("Recovery after a SIGKILL: median s per phase", loc="left", pad=14)
    fig.legend(loc="outside lower center", ncols=len(STACK), frameon=False)
    return fig


def reading(trials: list[harness.Trial]) -> str:
    """What the numbers say, from the numbers."""
    lines = []
    for n, by in configs(trials).items():
        m = {s: {key: median(mine, key) for key in PHASES} for s, mine in by.items()}
        parts = []
        if (r := m.get("replicas")) and r["total"]:
            redone = values(by["replicas"], "redone")
            met = r["total"] <= GOAL_S and redone and max(redone) <= 1
            parts.append(
                f"From the replicas distrain is back at work a median {r['total']:.2f} s after the kill and redoes "
                f"{harness.spread(redone, 'g')} step(s) per failure (goal ≤ {GOAL_S:g} s and 1 step: "
                f"{'met' if met else 'not met'}): detection {r['detection']:.2f} s, teardown {r['teardown']:.2f} s, "
                f"placement {r['placement']:.2f} s, process group {r['process_group']:.2f} s, state from a replica "
                f"{r['load']:.2f} s, first step {r['first_step']:.2f} s."
            )
        if (c := m.get("checkpoint")) and c["total"]:
            parts.append(
                f"From the checkpoint it takes {c['total']:.2f} s (load {c['load']:.2f} s) and redoes "
                f"{harness.spread(values(by['checkpoint'], 'redone'), 'g')} step(s): those since the last "
                f"checkpoint (one every {INTERVAL} steps) and the one in flight."
            )
        if (t := m.get("raytrain")) and t["total"]:
            best = min((v["total"] for k, v in m.items() if k != "raytrain" and v["total"]), default=None)
            vs = f", {t['total'] / best:.1f}× distrain's best" if best else ""
            parts.append(
                f"Ray Train takes {t['total']:.2f} s{vs}: {t['detect_teardown']:.2f} s until its old workers are "
                f"gone, {t['restart']:.2f} s more until its new group has formed the process group; it redoes "
                f"{harness.spread(values(by['raytrain'], 'redone'), 'g')} step(s), from the same checkpoints."
            )
        lines.append(f"- **{n} workers.** " + " ".join(parts))
    return "\n".join(lines)


def body(args, trials: list[harness.Trial], plot: str, efficiency_section: str = "") -> str:
    from distrain.driver.cli import compose
    from distrain.model.size import num_params

    cfg = compose(overrides(args, "replicas", args.workers[0], Path("/tmp"), "plan"))
    t, c, workers = cfg.trainer, cfg.cluster, " and ".join(map(str, args.workers))
    failed = [
        f"- {SYSTEMS[x.result.system]}, {x.result.workers} workers, repeat {x.repeat}: {x.result.error}"
        for x in trials
        if x.result.error
    ]
    nl = "\n"
    return f"""The same job trains under distrain's supervisor, with one hot spare (`cluster.spares=1`: a started and
warmed-up worker that takes a dead rank at once) in both of its systems, which differ only in the way back:
**from replicas** (`cluster.peer_recovery=true`, the default since `e6492a5`: the survivors keep their state in
memory and the spare takes the dead rank's from one of them, no checkpoint read) and **from checkpoint**
(`cluster.peer_recovery=false`: every rank reloads the last checkpoint, the behaviour before `e6492a5`); and
under Ray Train's `TorchTrainer` with `FailureConfig`, one run after the other on one embedded Ray cluster
(loopback only); a random worker process is SIGKILLed {args.kills} time(s) in each run. Recovery is the time from
the kill to the first completed training step after it, and **the steps redone per failure**: distrain, the
failed attempt's `step_begun` (the step in flight) minus the next attempt's `info.resumed_from_step`
(`summary.json`); Ray Train, which keeps no such record, the steps `metrics.jsonl` holds both before and after
the kill, plus the one in flight. Under Ray Train the train loop is distrain's own trainer
(`distrain.train.rank.run_rank`) on the same config, in the gloo process group Ray Train forms, resuming from the
same checkpoints on the same disk: model, data, checkpoint format and step are identical, so **the comparison is
of the orchestration alone**. The goals, from replicas on 4 workers: a median of ≤ {GOAL_S:g} s, and 0 steps lost
(only the step in flight redone: 1 step redone per failure).

- Job: `model={cfg.model.name}` ({num_params(cfg.model) / 1e6:.2f} M parameters), DDP on {workers} CPU workers \
({c.cpus_per_worker:g} CPU and {c.threads_per_worker} torch thread each, gloo), global batch {t.global_batch_size} × \
{t.seq_len} tokens, micro-batch {t.micro_batch_size}, fp32, {t.max_steps} steps, a checkpoint every {INTERVAL} \
steps. Each configuration (system × workers) runs {args.repeats} time(s), the order of all of them reversed on \
every other repeat; the 1-minute load average before each run is in the last table.
- The kill: once the run has logged step {FIRST} (kill i: {FIRST} + {GAP}·(i−1)), the killer holds it before its \
next step (`fault.hold_file`) until the run's hot spares are warm (an idle `ray::Worker` process under this \
driver holding no rank; at most {SPARE_WAIT_S:g} s), lets it go, and SIGKILLs a random rank at a random moment \
within that step. "Spare took it": the dead rank's successor was one of the spares warm at the kill. distrain: \
`cluster.max_failures={args.kills + 1} cluster.restart_backoff_s=0`; Ray Train: `FailureConfig(max_failures=\
{args.kills + 1})`, `ScalingConfig(use_gpu=False, resources_per_worker={{'CPU': {c.cpus_per_worker:g}}})`, its \
defaults otherwise (a health check every 2 s).
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

{nl.join(tables(trials))}
![median phases of each configuration]({plot})

## Reading

{reading(trials)}
- A spare saves what a new worker costs: a Python process that imports Ray, then torch and the trainer, and
  loads the corpus, all before it can join. The healthy actors are kept either way, their imports warm; the
  supervisor waits on the ranks' calls with `ray.wait`, so a death is seen at once.
- Ray Train sees the death at its controller's next poll (at most 2 s later), shuts the whole worker group down
  and starts a new one: a placement group and processes that each import torch and the trainer.
- GPU recovery (NCCL, CUDA contexts, larger checkpoints) is not measured here: this is the CPU/gloo path on one
  machine.
{f"{nl}Problems during the runs:{nl}{nl}{nl.join(failed)}{nl}" if failed else ""}
## Every kill

{nl.join(kill_rows(trials))}
{efficiency_section}"""


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if harness.replot(args, draw):
        return
    if "raytrain" in args.systems:
        import ray.train.torch  # noqa: F401  (now, not after distrain's runs)
    page = harness.Page("Recovery after a worker is killed: distrain from replicas or checkpoint, Ray Train", args)
    keys = [(system, n) for n in args.workers for system in args.systems]
    runners = {"checkpoint": run_distrain, "replicas": run_distrain, "raytrain": run_raytrain}
    windows = []
    with harness.storage(args) as storage, harness.ray_cluster(args.address, dashboard="raytrain" in args.systems):
        trials = harness.alternate(
            keys,
            args.repeats,
            lambda key, k: runners[key[0]](*key, k, args, storage),
            lambda key: f"{SYSTEMS[key[0]]}, {key[1]} workers, {args.kills} kill(s)",
        )
        if args.efficiency:
            windows = recovery_efficiency.measure(args, storage)
    print("\n" + "\n".join(tables(trials)))
    section = recovery_efficiency.section(args, windows) if windows else ""
    page.write(body(args, trials, page.plot, section), [*trials, *windows], plot=(draw, plot_data(trials)))
    if args.json:
        record = {"command": args.command, "trials": [asdict(t) for t in [*trials, *windows]]}
        Path(args.json).write_text(json.dumps(record, indent=1))
        print(f"bench_recovery: wrote {args.json}")
    if errors := [t.result.error for t in [*trials, *windows] if t.result.error]:
        raise SystemExit(f"bench_recovery: {len(errors)} run(s) had problems: {errors[0]}")


if __name__ == "__main__":
    main()
