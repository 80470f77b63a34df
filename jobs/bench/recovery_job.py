"""The job both recovery benchmarks train (bench_recovery.py's kills, recovery_efficiency.py's windows), and
what they read of its runs: the lines logged so far, the steps redone after a failure."""

from __future__ import annotations

import contextlib
from pathlib import Path

import harness

from distrain.storage.tracking import read_metrics

INTERVAL, FIRST, GAP, TAIL = 5, 12, 10, 5  # a checkpoint every 5 steps; kill i after step FIRST + GAP·(i−1)


def overrides(
    args, system: str, workers: int, storage: Path, name: str, steps: int = 0, interval: int = INTERVAL, kills: int = 0
) -> list[str]:
    """The Hydra overrides of one run: `python jobs/train.py <these>` trains the same job. fault.hold_file is
    how the killer pins the run down at a step boundary while it waits for a spare to be warm. `steps`,
    `interval` and `kills` default to bench_recovery's kill runs."""
    size, tail = "trainer.global_batch_size=32 trainer.micro_batch_size=8 trainer.seq_len=128", TAIL
    if args.smoke:  # its steps take milliseconds: a longer tail, or the run may end before the killer sees step FIRST
        tail = 4 * TAIL
        size = " ".join(harness.TINY)
    steps, kills = steps or FIRST + (args.kills - 1) * GAP + tail, kills or args.kills
    return [
        *harness.CPU_RUN,
        *(
            f"model=nano strategy=ddp cluster.num_workers={workers} cluster.spares={int(system != 'raytrain')} "
            f"cluster.peer_recovery={str(system != 'checkpoint').lower()} cluster.max_failures={kills + 1} "
            f"cluster.restart_backoff_s=0 checkpoint.interval={interval} trainer.max_steps={steps} {size} "
            f"trainer.eval_interval=0 trainer.eval_batches=1 fault.hold_file={storage / name}.hold "
            f"run.storage={storage} run.name={name}"
        ).split(),
    ]


def logged(run_dir: Path) -> list[dict]:
    """metrics.jsonl as it is now; [] while a line is half-written (the next look has it whole)."""
    with contextlib.suppress(ValueError):
        return read_metrics(str(run_dir))
    return []


def redone(failed: dict, next_attempt: dict) -> int:
    """Steps done twice after a failure: the last step the failed attempt began (the one in flight) minus
    the step the next one resumed from (summary.json's records of the two attempts)."""
    return failed["step_begun"] - next_attempt["info"].get("resumed_from_step", 0)
