"""What a run's directory decides before any cluster is asked for: the directory made, the run's lock taken
(on an object store, its lock there too), and whether its newest checkpoint can be resumed by this config
and leaves steps to train. A refusal here (a run in use, another model, a finished run) comes before Ray
starts, and leaves the directory as it was."""

from __future__ import annotations

import contextlib
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from distrain.config import ConfigError, TrainConfig, to_plain
from distrain.data.checks import check_same_shards
from distrain.driver import finetune
from distrain.driver.objectrun import on_store, patiently
from distrain.driver.stop import StoppedBeforeStart
from distrain.storage import checkpoint, remote
from distrain.storage.fsutil import exclusive_lock, make_writable_dir, remove_empty
from distrain.storage.objectstore import store_for

LOCK_FILE = ".lock"  # held by the driver while the run trains: one writer per run directory
Found = tuple[Path | None, dict]  # the checkpoint a (re)start resumes from, and its metadata


@contextlib.contextmanager
def claimed(cfg: TrainConfig, say: Callable[[str], None]) -> Iterator[tuple[Path, Found]]:
    """The run directory, held (its lock, and on an object store the store's lock and the record pulled and
    synced) for as long as the run trains, and its newest checkpoint, checked against `cfg`. A refusal, or
    anything raised while it is held, leaves behind no directory made for it that is still empty; a stop before
    the first step (a KeyboardInterrupt: `launch.train`), none made for it at all."""
    run_dir, made = make_run_dir(cfg)
    new = run_dir if run_dir in made and not cfg.run_url else None  # (on a store, the record may be there already)
    try:
        with on_store(cfg, run_dir, say), exclusive_lock(run_dir / LOCK_FILE), leaving_nothing(new, LOCK_FILE):
            found = newest_checkpoint(cfg, run_dir)
            if found[0] is not None:
                check_resumable(found[1].get("config"), to_plain(cfg))
                finetune.check_base(found[1], cfg)
                check_steps_left(found[1], cfg, say)
            yield run_dir, found
    except BaseException:
        remove_empty(made)
        raise


@contextlib.contextmanager
def leaving_nothing(run_dir: Path | None, keep: str) -> Iterator[None]:
    """A stop before the run trained a step or recorded a failure (StoppedBeforeStart) empties `run_dir`, a run
    directory this invocation made, but for `keep` (its lock, still held; the directory itself goes once that is
    let go). None: a directory that was there, never touched; nor is one that holds checkpoints (a step's save
    committed before the supervisor heard of the step). Any other interrupt (a second Ctrl-C while a run that
    has trained writes its record, say) leaves every file."""
    try:
        yield
    except StoppedBeforeStart:
        if run_dir is not None and not (run_dir / "checkpoints").exists():
            for entry in run_dir.iterdir():
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                elif entry.name != keep:
                    entry.unlink()
        raise


def make_run_dir(cfg: TrainConfig) -> tuple[Path, list[Path]]:
    """The run directory (a run on an object store: its local mirror), made and written to once, and the
    directories made for it (deepest first); or a one-line ConfigError about run.storage (read-only, a file,
    /sys), or storage.cache_dir, with nothing left behind."""
    run_dir = Path(cfg.run_dir)
    try:
        return run_dir, make_writable_dir(run_dir)
    except OSError as e:
        key = f"storage.cache_dir={cfg.storage.cache_dir!r}" if cfg.run_url else f"run.storage={cfg.run.storage!r}"
        raise ConfigError(
            f"{key} cannot hold the run directory {str(run_dir)!r} ({e.strerror or e}): give a directory you can write"
        ) from None


def newest_checkpoint(cfg: TrainConfig, run_dir: Path, say: Callable[[str], None] | None = None) -> Found:
    """The checkpoint a (re)start resumes from, and its metadata: the newest that verifies in the run
    directory; with an object store, the newest committed there (its marker and meta.json read from the
    store, nothing downloaded: each rank fetches it into its node's mirror, where this path names it). With
    `say` (an attempt's start), a store that does not answer is waited for (objectrun.patiently)."""
    if cfg.run_url:
        store = store_for(cfg.run_url, cfg.storage)
        found = patiently(cfg, lambda: remote.latest_meta(store), say) if say else remote.latest_meta(store)
        return (run_dir / remote.PREFIX / found[0], found[1]) if found else (None, {})
    path = checkpoint.latest(run_dir / "checkpoints")
    return path, (checkpoint.read_meta(path) if path else {})


def check_resumable(saved: dict | None, current: dict) -> None:
    """A checkpoint resumes only into the same model; data and batch changes are allowed but break
    the promise of an exact resume, so they are pointed out; other token shards are refused."""
    if saved is None:
        return
    check_same_shards(saved, current)
    for key, old in saved["model"].items():
        new = current["model"].get(key)
        if new != old:
            raise ConfigError(
                f"run {current['run']['name']!r} was trained with model.{key}={old!r}, this config has {new!r}: "
                f"resume with the same model, or start a new run.name"
            )
    for section, key in (
        ("trainer", "seed"),
        ("trainer", "global_batch_size"),
        ("trainer", "seq_len"),
        ("data", "path"),
    ):
        if saved[section][key] != current[section][key]:
            warnings.warn(
                f"resuming with {section}.{key}={current[section][key]!r} (the checkpoint's run used "
                f"{saved[section][key]!r}): training continues, but not as the original run would have",
                stacklevel=2,
            )


def check_steps_left(meta: dict, cfg: TrainConfig, say: Callable[[str], None]) -> None:
    """A rerun whose checkpoint is already at trainer.max_steps would train nothing: refused. One asking
    for more (or fewer) steps than the checkpoint's run extends (or shortens) it, which is said: the LR
    schedule follows trainer.max_steps unless optim.decay_steps fixes its length, so its LR changes."""
    step, steps, name = meta["step"], cfg.trainer.max_steps, cfg.run.name
    if step >= steps:
        raise ConfigError(
            f"run {name!r} has trained {step} steps, so trainer.max_steps={steps} leaves nothing to train: give "
            f"trainer.max_steps above {step} to extend it, or a new run.name"
        )
    before = (meta.get("config") or {}).get("trainer", {}).get("max_steps")
    if before is not None and before != steps:
        how = "stretches to" if before < steps else "shrinks to"
        schedule = (
            f"optim.decay_steps={cfg.optim.decay_steps} keeps the LR schedule"
            if cfg.optim.decay_steps
            else f"the LR schedule {how} the new length (set optim.decay_steps={before} to keep it)"
        )
        change = "extending" if before < steps else "shortening"
        say(f"{change} run {name!r} from trainer.max_steps={before} to {steps}, from step {step}: {schedule}")
