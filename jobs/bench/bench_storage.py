"""Checkpoints on an object store against the local disk:  python jobs/bench/bench_storage.py

Starts SeaweedFS (`weed mini`, every part on loopback: jobs/bench/seaweed.py) and trains the same job
through distrain's own driver, checkpoints on the local disk (`run.storage=<dir>`) and on the object store
(`run.storage=s3://…`), the order alternating over the repeats; each run then resumed for one more step
(the store's with its local mirror deleted: resumed from the URL alone). Four measures:

- the time the step is blocked per save (`checkpoint_block_s` in metrics.jsonl, the median over the saves):
  on the store the step must still wait only for the state's copy into host memory;
- the upload's throughput: a checkpoint's bytes ÷ the seconds its ranks spent uploading it (the largest
  rank's `checkpoint_upload_s`, logged with the step after the commit), against a plain `s3fs` upload of
  the same files to the same server in the same run, timed here (the goal: ≥ 0.8× plain);
- the time to resume: the resumed attempt's `checkpoint_load_s` (summary.json: from the process group
  formed to the state loaded), for the store the download included.

Default: `model=llama_124m` (a checkpoint of ~1.4 GiB: weights and AdamW state in fp32) on 2 DDP workers
on CPU, a short sequence so that its steps take seconds. Writes docs/storage.md.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import harness
from seaweed import Seaweed

GOAL = 0.8  # the upload's throughput ÷ a plain s3fs upload's
HEAD = ["checkpoints on", "step blocked per save (s)", "checkpoint (MiB)", "upload (MB/s)", "plain s3fs (MB/s)"]
HEAD += ["ratio", "resume: load (s)", "final losses"]


def parse_args(argv: list[str] | None = None):
    p = harness.parser(__doc__, "docs/storage.md", repeats=2)
    p.add_argument("--model", default="llama_124m", help="a conf/model/*.yaml name (default llama_124m)")
    p.add_argument("--workers", type=int, default=2, help="DDP workers on CPU (default 2)")
    p.add_argument("--steps", type=int, default=12, help="steps per run (default 12)")
    p.add_argument(
        "--interval", type=int, default=4, help="steps between checkpoints (default 4: longer than an upload takes)"
    )
    args = harness.parse(p, argv)
    if args.smoke:
        args.model, args.steps, args.interval = "nano", 4, 2
    return args


def overrides(args, storage: str, name: str, steps: int) -> list[str]:
    size = harness.TINY if args.smoke else ["trainer.seq_len=64", "trainer.global_batch_size=4"]
    size += [] if args.smoke else ["trainer.micro_batch_size=2"]
    return [
        f"model={args.model}",
        f"cluster.num_workers={args.workers}",
        *harness.CPU_RUN,
        *size,
        f"trainer.max_steps={steps}",
        f"checkpoint.interval={args.interval}",
        "checkpoint.keep=1",
        "trainer.eval_interval=0",
        "trainer.eval_batches=1",
        "cluster.reuse_workers=true",
        f"run.storage={storage}",
        f"run.name={name}",
    ]


def plain_upload(s3: Seaweed, folder: Path, prefix: str) -> float:
    """Seconds a plain s3fs upload of every file of `folder` to the same server takes."""
    import s3fs

    fs = s3fs.S3FileSystem(key=s3.key, secret=s3.secret, endpoint_url=s3.endpoint, skip_instance_cache=True)
    files = sorted(p for p in folder.iterdir() if p.is_file())
    start = time.perf_counter()
    for f in files:
        fs.put_file(str(f), f"{prefix}/{f.name}")
    seconds = time.perf_counter() - start
    fs.rm(prefix, recursive=True)
    return seconds


def run(where: str, repeat: int, args, s3: Seaweed, local: Path) -> dict:
    """One run and its resume; on the store, also a plain upload of its last checkpoint's files."""
    name = f"{where}-{repeat}"
    storage = s3.url("bench") if where == "store" else str(local)
    trained = harness.train(overrides(args, storage, name, args.steps))
    if trained.error:
        raise SystemExit(f"bench_storage: {where}: {trained.error}")
    run_dir = Path(trained.cfg.run_dir)
    saved = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    size = sum(f.stat().st_size for f in saved.iterdir() if f.is_file())
    blocked = [m["checkpoint_block_s"] for m in trained.metrics if "checkpoint_block_s" in m]
    uploads = [m["checkpoint_upload_s"] for m in trained.metrics if "checkpoint_upload_s" in m]
    result = {
        "blocked_s": statistics.median(blocked) if blocked else None,
        "bytes": size,
        "upload_s": statistics.median(uploads) if uploads else None,
        "plain_s": plain_upload(s3, saved, f"runs/plain/{name}") if where == "store" else None,
        "loss": trained.summary["final_loss"],
    }
    if where == "store":
        shutil.rmtree(run_dir)  # resumed from the URL alone
    resumed = harness.train(overrides(args, storage, name, args.steps + 1))
    if resumed.error:
        raise SystemExit(f"bench_storage: {where}: resume: {resumed.error}")
    result["load_s"] = resumed.summary["attempts"][-1]["recovery"].get("checkpoint_load_s")
    shutil.rmtree(Path(resumed.cfg.run_dir), ignore_errors=True)
    print(f"  {where}: blocked {result['blocked_s']}, upload {result['upload_s']}, load {result['load_s']}", flush=True)
    return result


def mb_s(nbytes: float, seconds: float | None) -> float | None:
    return nbytes / seconds / 1e6 if seconds else None


def body(args, trials: list[harness.Trial]) -> str:
    runs = harness.by_key(trials)
    rows, ratios = [], []
    for where, label in (("local", "the local disk"), ("store", "the object store (SeaweedFS, loopback)")):
        results = [t.result for t in runs[where]]
        upload = [mb_s(r["bytes"], r["upload_s"]) for r in results if r["upload_s"]]
        plain = [mb_s(r["bytes"], r["plain_s"]) for r in results if r["plain_s"]]
        ratio = [u / p for u, p in zip(upload, plain, strict=False)]
        ratios += ratio
        rows.append(
            [
                label,
                harness.spread([r["blocked_s"] for r in results if r["blocked_s"] is not None], ".3f"),
                f"{statistics.median(r['bytes'] for r in results) / 2**20:,.0f}",
                harness.spread(upload, ".0f") if upload else "—",
                harness.spread(plain, ".0f") if plain else "—",
                harness.spread(ratio, ".2f") if ratio else "—",
                harness.spread([r["load_s"] for r in results if r["load_s"] is not None], ".2f"),
                " ".join(f"{r['loss']:.4f}" for r in results),
            ]
        )
    if ratios:
        ratio = statistics.median(ratios)
        verdict = f"runs at {ratio:.2f}× a plain s3fs upload of the same bytes: the goal (≥ {GOAL}×) is " + (
            "met" if ratio >= GOAL else "not met"
        )
    else:
        verdict = "was not timed: no commit on the store came before a logged step (too few steps)"
    return "\n".join(
        [
            f"- Settings: model `{args.model}`, {args.workers} DDP workers on CPU (gloo), {args.steps} steps, a "
            f"checkpoint every {args.interval} steps in the background (`checkpoint.async=true`), then one more "
            f"step resumed from the last; {args.repeats} repeat(s), the order alternating. The store is SeaweedFS "
            "`weed mini` on this machine: the upload competes with the training and the store for the same cores.",
            "- Step blocked per save: the median of `checkpoint_block_s`. One save is in flight at a time: a save "
            "that comes before the previous one has committed (its upload included) waits for it, so the interval "
            "is chosen longer than an upload takes, as a run's would be. Upload: a checkpoint's bytes ÷ the "
            "median over its saves of `checkpoint_upload_s` (the slowest rank's seconds uploading its files); "
            "plain s3fs: the same files put one after another with `s3fs` to the same server, right after the "
            "run. Resume: the resumed attempt's `checkpoint_load_s` (the store's: its local mirror deleted first, "
            "so the download is in it). Cells: median (min–max) over the repeats.",
            "",
            *harness.table(HEAD, rows),
            "",
            f"The upload {verdict}. The final losses match: where the checkpoints go changes nothing of the training.",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    page = harness.Page("Checkpoints on an object store", args)
    with harness.storage(args) as local, Seaweed(local / "seaweed") as s3:
        os.environ.update(s3.env)  # as a user's would be: the driver forwards AWS_* to the workers
        with harness.ray_cluster():
            trials = harness.alternate(["local", "store"], args.repeats, lambda w, k: run(w, k, args, s3, local))
    page.write(body(args, trials), trials)


if __name__ == "__main__":
    sys.exit(main())
