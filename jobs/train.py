"""The main entrypoint, locally and under `ray job submit`:  python jobs/train.py [Hydra overrides]

Bad input gets one line and exit status 2, a failed run exit status 1 (what `ray job submit`
reports as FAILED)."""

import sys
import time

import hydra
from omegaconf import DictConfig, OmegaConf

from distrain.cli import CONF_DIR, BadInput, check_group_choices, plan_overrides, register

STARTUP: dict[str, float] = {}  # wall-clock marks of this process's own start, for summary.json


def fail(message: str, code: int = 2) -> None:
    print(f"distrain: error: {message}", file=sys.stderr)
    raise SystemExit(code)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def main(cfg: DictConfig) -> None:
    """Train (or with `plan=true` print the layout). Imports here, not at the top, so `--cfg job`
    and a bad group choice do not wait for Ray to load."""
    STARTUP["composed_at"] = time.time()
    from distrain.cluster.placement import PlacementError, WorkerFailure
    from distrain.cluster.runtime import CapacityError
    from distrain.config import ConfigError
    from distrain.fsutil import LockedError
    from distrain.launch import train

    config = OmegaConf.to_object(cfg)
    try:
        summary = train(config, STARTUP)
    except (ConfigError, CapacityError, PlacementError, LockedError) as e:
        fail(str(e))
    except WorkerFailure as e:
        fail(f"training failed: {e}", code=1)
    if config.plan:
        print(summary["plan"])
        return
    nan = float("nan")
    print(
        f"distrain: {summary['status']} at step {summary['final_step']}: loss {summary['final_loss'] or nan:.4f}, "
        f"val loss {summary.get('final_val_loss') or nan:.4f}, {summary['wall_s']:.1f}s, "
        f"{summary['restarts']} restarts; run directory {config.run_dir}"
    )
    if summary["status"] == "stopped":
        print(f"distrain: stopped on request; the same command with run.name={config.run.name} resumes it")


if __name__ == "__main__":
    STARTUP["imported_at"] = time.time()
    sys.argv[1:] = plan_overrides(sys.argv[1:])
    try:
        check_group_choices(sys.argv[1:])
    except BadInput as e:
        fail(str(e))
    register()
    main()
