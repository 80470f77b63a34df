"""Train a model, locally and under `ray job submit`:

    distrain train [--config-dir DIR] [Hydra overrides]      (a checkout: python jobs/train.py [...])

--plan: the layout and its memory, nothing trained; --cfg job: the composed config; -m: a sweep; --help: the
commands, the overrides most used and each group's presets. --config-dir DIR: presets of your own beside the
shipped ones (DIR/model/mine.yaml is model=mine).

Exit status: 0 a completed run (or sweep of completed runs); 2 bad input, refused before anything is
written; 1 a failed run, an embedded Ray cluster that did not start (twice), or a sweep with a point that
did not complete; 128 + the signal for a run stopped by a signal (130 Ctrl-C, 143 SIGTERM, e.g. `ray job
stop`): a stopped run is not finished, so neither a shell nor `ray job submit` may take it for a success.
The console output is kept in the run directory (logs/driver-*.log)."""

import signal
import sys
import time
from pathlib import Path

STARTUP: dict[str, float] = {"imported_at": time.time()}  # wall-clock marks of this process's start

from distrain.driver.cli import (  # noqa: E402
    CONF_DIR,
    BadInput,
    check_flags,
    check_overrides,
    config_dirs,
    overrides_of,
    plan_overrides,
    register,
)
from distrain.driver.console import DriverLog  # noqa: E402
from distrain.driver.sweep import Point, point_name, point_values, sweep_overrides, swept_keys, table, write_record  # noqa: E402

LOG = DriverLog()
SWEEP: dict = {"keys": set(), "points": [], "dir": None, "planned": []}  # planned: a basic sweep's points, in order
CURRENT: dict = {}  # the run being started: what a Ctrl-C reports on


def fail(message: str, code: int = 2) -> int:
    print(f"distrain: error: {message}", file=sys.stderr)
    CURRENT["error"] = message  # a sweep's table repeats it
    return code


def run(config, record) -> tuple[int, dict | None]:
    """Train one run: (exit status, summary); errors printed in one line."""
    from distrain.cluster.placement import PlacementError, WorkerFailure
    from distrain.cluster.runtime import CapacityError, StartError
    from distrain.config import ConfigError
    from distrain.driver.launch import train
    from distrain.storage.fsutil import LockedError
    from distrain.storage.objectstore import StorageError
    from distrain.storage.safeload import DamagedCheckpointError

    CURRENT["config"] = config
    try:
        summary = train(config, STARTUP, record)
    except (ConfigError, CapacityError, PlacementError, LockedError, DamagedCheckpointError, StorageError) as e:
        return fail(str(e)), None
    except WorkerFailure as e:
        return fail(f"training failed: {e}", code=1), None
    except StartError as e:  # not the input: the same command may start it when the machine is quieter
        return fail(str(e), code=1), None
    return report(config, summary)


def report(config, summary: dict) -> tuple[int, dict]:
    """The run's last lines, and its exit status."""
    if config.plan:
        print(summary["plan"])
        return 0, summary
    loss, val = summary.get("final_loss"), summary.get("final_val_loss")
    print(
        f"distrain: {summary['status']} at step {summary['final_step']}: "
        f"loss {f'{loss:.4f}' if loss is not None else '(no step trained)'}, "
        f"{f'val loss {val:.4f}' if val is not None else 'no evaluation'}, {summary['wall_s']:.1f}s, "
        f"{summary['restarts']} restart{'' if summary['restarts'] == 1 else 's'}; {where(config)}"
    )
    if summary["status"] != "stopped":
        return 0, summary
    sig = summary.get("stop_signal", signal.SIGTERM)
    print(f"distrain: stopped by {signal.Signals(sig).name}: {run_state()} (exit status {128 + sig})")
    return 128 + sig, summary


def where(config) -> str:
    """Where the run is kept: its directory, or its URL and this machine's mirror of it."""
    return (
        f"run {config.run_url} (mirrored in {config.run_dir})" if config.run_url else f"run directory {config.run_dir}"
    )


def run_state() -> str:
    """What a stopped or interrupted run leaves: its newest committed checkpoint, if any."""
    config = CURRENT.get("config")
    if config is None:
        return "nothing was started"
    from distrain.storage import checkpoint

    latest = checkpoint.latest(Path(config.run_dir) / "checkpoints")
    if latest is None:
        return f"run {config.run.name!r} has trained nothing"
    step = checkpoint.read_meta(latest)["step"]
    return f"run {config.run.name!r} resumes from step {step} with the same command and run.name={config.run.name}"


def task(cfg) -> float | None:
    """Train (or with `plan=true` print the layout) the composed config; in a sweep, one point of it, whose
    objective it returns to the sweeper. Imports here, not at the top, so `--cfg job` and bad input do not
    wait for Ray to load."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from distrain.driver.sweep import earlier_result, objective
    from distrain.redaction import redact, redact_override

    STARTUP["composed_at"] = time.time()
    hydra = HydraConfig.get()
    sweeping = hydra.mode == RunMode.MULTIRUN
    values = point_values(list(hydra.overrides.task), SWEEP["keys"]) if sweeping else []
    if sweeping:
        cfg.run.name = point_name(cfg.run.name, values, SWEEP["keys"])
        SWEEP["dir"] = hydra.sweep.dir

    def record(run_dir: Path) -> None:
        """Hydra's record of this invocation (config, overrides) and the console log, in the run directory."""
        LOG.open(run_dir)
        out = run_dir / "hydra" / time.strftime("%Y%m%d-%H%M%S") / ".hydra"  # Hydra's own layout
        out.mkdir(parents=True, exist_ok=True)
        kept = cfg.copy()  # storage.options redacted, should a secret have been put there (redaction.redact)
        kept.storage.options = redact(OmegaConf.to_container(cfg.storage.options, resolve=True))
        OmegaConf.save(kept, out / "config.yaml")
        OmegaConf.save(OmegaConf.create([redact_override(o) for o in hydra.overrides.task]), out / "overrides.yaml")

    config = OmegaConf.to_object(cfg)
    earlier = earlier_result(config.run_dir, cfg) if sweeping else None
    if earlier:
        print(f"distrain: run {config.run.name!r} completed this point with this config: its result again")
    try:
        code, summary = (0, earlier) if earlier else run(config, record)
    except KeyboardInterrupt:  # stopped before its first step: the sweep's table lists it all the same
        if sweeping:
            SWEEP["points"].append(point(values, config, "stopped", None, None))
        raise
    except Exception as e:
        if not sweeping:
            raise
        code, summary = fail(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", code=1), None
    finally:
        LOG.close()
        upload_log(config)
    if not sweeping:
        if code:
            raise SystemExit(code)
        return None
    status = "reused" if earlier else {0: "completed", 2: "refused", 1: "failed"}.get(code, "stopped")
    value = objective(summary, config.run.objective)
    SWEEP["points"].append(point(values, config, status, summary, value))
    if status == "stopped":
        raise SystemExit(code)  # a signal stops the sweep, not only its point (the table still ends it)
    return value


def point(values: list[str], config, status: str, summary: dict | None, value: float | None) -> Point:
    """A sweep's point as its table and record show it."""
    return Point(
        overrides=" ".join(values),
        run_dir=config.run_dir if Path(config.run_dir).is_dir() else None,
        status=status,
        final_loss=(summary or {}).get("final_loss"),
        final_val_loss=(summary or {}).get("final_val_loss"),
        error=CURRENT.pop("error", None),
        objective=value,
    )


def upload_log(config) -> None:
    """A run on an object store: this invocation's driver log once more, now that it has its last lines (the
    run's record was uploaded as the run ended, before them)."""
    if LOG.path is None or not config.run_url or not LOG.path.is_relative_to(config.run_dir):
        return
    from distrain.storage.objectstore import StorageError, store_for

    name = LOG.path.relative_to(config.run_dir).as_posix()
    try:
        store_for(config.run_url, config.storage).upload(Path(config.run_dir), [name], "")
    except StorageError as e:
        print(f"distrain: the driver log's last lines are only in {LOG.path}: {e}", file=sys.stderr)


def check_sweep_storage(overrides: list[str]) -> None:
    """Hydra makes a sweep's directory (under run.storage) before any point's config is checked: check first.
    A sweep's record is kept in a directory: a URL is refused (Hydra would make a local folder named 's3:'), and
    so is one not well-formed (a sampling sweeper's points are checked only as they come)."""
    from distrain.config import RunConfig
    from distrain.storage.fsutil import make_writable_dir
    from distrain.urls import check_location, is_url

    given = [o.partition("=")[2] for o in overrides if o.lstrip("+").startswith("run.storage=")]
    storage = given[-1] if given else RunConfig.storage
    for each in storage.split(","):
        try:
            check_location(each, "run.storage")
        except ValueError as e:
            raise BadInput(str(e)) from None
    if any(is_url(s) for s in storage.split(",")):
        raise BadInput(
            f"run.storage={storage!r}: a sweep (-m) keeps its record in a directory, and a URL is not one: sweep "
            f"with run.storage on a local or shared directory, or train each point as its own run on the store"
        )
    if "," in storage:
        return  # swept: each point checks its own
    try:
        make_writable_dir(Path(storage) / "sweeps")
    except OSError as e:
        raise BadInput(
            f"run.storage={storage!r} cannot hold the sweep ({e.strerror or e}): give a directory you can write"
        ) from None


def entry(argv: list[str]) -> int:
    import hydra

    from distrain.driver.sweep import check_points, not_run

    multirun = [a for a in argv if a in ("-m", "--multirun")]
    argv = [*multirun, *plan_overrides([a for a in argv if a not in multirun])]  # Hydra's parser wants it first
    try:
        check_flags(argv)
        dirs = config_dirs(argv)
        overrides = overrides_of(argv)
        check_overrides(overrides, dirs)
        if multirun:
            SWEEP["keys"] = swept_keys(overrides)
            argv = sweep_overrides(argv)
            SWEEP["planned"] = check_points(overrides_of(argv), SWEEP["keys"], dirs) or []
            check_sweep_storage(overrides)
    except BadInput as e:
        return fail(str(e))
    register()
    sys.argv[1:] = argv
    try:
        hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")(task)()
    except KeyboardInterrupt as e:  # distrain.driver.stop.Stopped names the signal; a bare one is Ctrl-C
        sig = getattr(e, "signum", signal.SIGINT)
        name = signal.Signals(sig).name
        print(f"distrain: stopped by {name}: {run_state()} (exit status {128 + sig})", file=sys.stderr)
        return 128 + sig
    finally:
        if SWEEP["points"]:  # and, if it was stopped, the points it never reached
            points = [*SWEEP["points"], *not_run(SWEEP["planned"], SWEEP["points"])]
            print(table(points))
            write_record(SWEEP["dir"], points)
    return 1 if any(p.status not in ("completed", "reused") for p in SWEEP["points"]) else 0


def main(argv: list[str]) -> int:
    """The command: the console kept from here on, the run, and its exit status (the module's docstring); a
    signal after the last line ends the process at once with that status."""
    from distrain.driver.stop import exit_at_signal

    LOG.start()
    try:
        status = entry(argv)
    except SystemExit as e:  # a run's own status, from task
        status = e.code if isinstance(e.code, int) else int(e.code is not None)
    exit_at_signal(status)
    return status
