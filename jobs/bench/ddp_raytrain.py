"""jobs/bench/ddp_torchrun.py's DDP loop under Ray Train's TorchTrainer, for jobs/bench/bench_ddp.py.

    python jobs/bench/ddp_raytrain.py --workers N [--model nano --steps 60 ...]

What a user of Ray Train would write for the same job: a local Ray cluster on loopback (as
jobs/bench/bench_recovery.py starts one for Ray Train), a worker per rank with distrain's CPU share and torch
threads per worker, gloo on loopback, and `ray.train.report` on every rank after every step, as for a
user who logs every step. Rank 0 returns its records; once fit() returns, this driver prints them as
ddp_torchrun.py's JSON lines (each holds the time its step ended, so printing them late changes nothing
that is measured, and no line is lost in Ray's forwarding of worker output).
"""

from __future__ import annotations

import argparse
import tempfile

import ddp_torchrun
import harness  # before Ray: it keeps Ray on loopback
import ray.train
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer, get_device

from distrain.driver.cli import compose


def train_loop(config: dict) -> list[dict]:
    """One Ray Train worker: the shared loop in the process group Ray Train formed."""
    records = []

    def record(figures: dict) -> None:
        ray.train.report(figures)  # collective: every rank reports every step
        records.append(figures)

    ddp_torchrun.train(argparse.Namespace(**config), get_device(), record)
    return records


def main() -> None:
    p = ddp_torchrun.parser()
    p.description = __doc__.splitlines()[0]
    p.add_argument("--workers", type=int, default=2, help="DDP ranks, a Ray Train worker each")
    args = p.parse_args()
    cluster = compose().cluster  # distrain's defaults: the CPU share and torch threads of a worker
    env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": str(cluster.threads_per_worker)}
    # Ray Train's placement-group cleaner asks the state API whether its controller lives: hence the dashboard.
    with tempfile.TemporaryDirectory(prefix="ddp_raytrain_") as storage, harness.ray_cluster(dashboard=True):
        trainer = TorchTrainer(
            train_loop,
            train_loop_config=vars(args),
            scaling_config=ScalingConfig(
                num_workers=args.workers,
                use_gpu=torch.cuda.is_available(),
                resources_per_worker={"CPU": cluster.cpus_per_worker},
            ),
            run_config=RunConfig(name="ddp_raytrain", storage_path=storage, worker_runtime_env={"env_vars": env}),
        )
        result = trainer.fit()
    for record in result.return_value:
        ddp_torchrun.print_record(record)


if __name__ == "__main__":
    main()
