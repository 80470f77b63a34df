"""Checkpoints on an object store against the local disk:  python jobs/bench/bench_storage.py

Starts SeaweedFS (`weed mini`, every part on loopback: distrain/testing/seaweed.py) and trains the same job
through distrain's own driver, checkpoints on the local disk (`run.storage=<dir>`) and on the object store
(`run.storage=s3://…`), the order alternating over the repeats; each run then resumed for one more step
(the store's with its local mirror deleted: resumed from the URL alone). Three measures:

- the time the step is blocked per save (`checkpoint_block_s` in metrics.jsonl, the median over the saves):
  on the store the step must still wait only for the state's copy into host memory;
- the upload's throughput: a checkpoint's bytes ÷ the seconds its ranks spent uploading it in the run (the
  slowest rank's `checkpoint_upload_s`, logged with the step after the commit), and ÷ the seconds the same
  uploader takes for the same files right after the run; against a plain `s3fs` upload of the same files
  to the same server, timed here beside it (the goal: ≥ 0.8× plain);
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
import threading
import time
from pathlib import Path

import harness

from distrain.testing.seaweed import Seaweed

GOAL = 0.8  # the upload's throughput ÷ a plain s3fs upload's
HEAD = ["checkpoints on", "step blocked per save (s)", "checkpoint (MiB)", "upload in the run (MB/s)"]
HEAD += ["uploader alone (MB/s)", "plain s3fs (MB/s)", "ratio", "resume: load (s)", "final losses"]


def parse_args(argv: list[str] | None = None):
    p = harness.parser(__doc__, "docs/storage.md", repeats=2, cluster=True)
    p.add_argument("--model", default="llama_124m", help="a conf/model/*.yaml name (default llama_124m)")
    p.add_argument("--workers", type=int, default=2, help="DDP workers on CPU (default 2)")
    p.add_argument("--steps", type=int, default=60, help="steps per run (default 60)")
    p.add_argument(
        "--interval", type=int, default=20, help="steps between checkpoints (default 20: longer than an upload takes)"
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


def uploader_alone(s3: Seaweed, folder: Path, prefix: str) -> float:
    """Seconds distrain's uploader takes for the same files on a quiet machine: each writer's files from a
    thread of its own (the ranks upload at once), through `Store.upload` as `storage/remote.py` calls it."""
    from distrain.storage.checkpoint import writer_of
    from distrain.storage.objectstore import Store

    store = Store(s3.url())
    by_writer: dict[int, list[str]] = {}
    for f in sorted(p for p in folder.iterdir() if p.is_file()):
        by_writer.setdefault(writer_of(f.name) or 0, []).append(f.name)
    threads = [threading.Thread(target=store.upload, args=(folder, names, prefix)) for names in by_writer.values()]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    store.remove(prefix)
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
        "alone_s": uploader_alone(s3, saved, f"alone/{name}") if where == "store" else None,
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
    rows, alone_ratio, run_ratio = [], [], []
    for where, label in (("local", "the local disk"), ("store", "the object store (SeaweedFS, loopback)")):
        results = [t.result for t in runs[where]]
        speeds = {
            key: [mb_s(r["bytes"], r[key]) for r in results if r[key]] for key in ("upload_s", "alone_s", "plain_s")
        }
        for r in results:
            if r["plain_s"] and r["alone_s"]:
                alone_ratio.append(r["plain_s"] / r["alone_s"])
            if r["plain_s"] and r["upload_s"]:
                run_ratio.append(r["plain_s"] / r["upload_s"])
        rows.append(
            [
                label,
                harness.spread([r["blocked_s"] for r in results if r["blocked_s"] is not None], ".3f"),
                f"{statistics.median(r['bytes'] for r in results) / 2**20:,.0f}",
                *(
                    harness.spread(speeds[key], ".0f") if speeds[key] else "—"
                    for key in ("upload_s", "alone_s", "plain_s")
                ),
                harness.spread(alone_ratio, ".2f") if where == "store" and alone_ratio else "—",
                harness.spread([r["load_s"] for r in results if r["load_s"] is not None], ".2f"),
                " ".join(f"{r['loss']:.4f}" for r in results),
            ]
        )
    if alone_ratio:
        ratio = statistics.median(alone_ratio)
        verdict = (
            f"distrain's uploader moves a checkpoint at {ratio:.2f}× the throughput of a plain s3fs upload of the "
            f"same bytes to the same server: the goal (≥ {GOAL}×) is {'met' if ratio >= GOAL else 'not met'}"
        )
        if run_ratio:
            verdict += (
                f". During the run, sharing the 2 cores with the training and the store, it reaches "
                f"{statistics.median(run_ratio):.2f}× of that plain upload on a quiet machine"
            )
    else:
        verdict = "was not timed (a smoke run)"
    return "\n".join(
        [
            f"- Settings: model `{args.model}`, {args.workers} DDP workers on CPU (gloo), {args.steps} steps, a "
            f"checkpoint every {args.interval} steps in the background (`checkpoint.async=true`), then one more "
            f"step resumed from the last; {args.repeats} repeat(s), the order alternating. The store is SeaweedFS "
            "`weed mini` on this machine: the upload competes with the training and the store for the same cores.",
            "- Step blocked per save: the median of `checkpoint_block_s`. One save is in flight at a time: a save "
            "that comes before the previous one has committed (its upload included) waits for it, so the interval "
            "is chosen longer than an upload takes, as a run's would be.",
            "- Upload, in MB/s of a checkpoint's bytes: *in the run*, over the median of `checkpoint_upload_s` "
            "(the slowest rank's seconds uploading its files, while training goes on); *uploader alone*, the "
            "same files of the run's last checkpoint uploaded right after the run through `Store.upload`, each "
            "writer's files from a thread of its own as the ranks do; *plain s3fs*, the same files put one after "
            "another with `s3fs` to the same server. Ratio: uploader alone ÷ plain s3fs, the two on a quiet "
            "machine. Resume: the resumed attempt's `checkpoint_load_s` (the store's: its local mirror deleted "
            "first, so the download is in it). Cells: median (min–max) over the repeats.",
            "",
            *harness.table(HEAD, rows),
            "",
            f"The upload: {verdict}. The final losses match: where the checkpoints go changes nothing of the training.",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    page = harness.Page("Checkpoints on an object store", args)
    with harness.storage(args) as local, Seaweed(local / "seaweed") as s3:
        os.environ.update(s3.env)  # as a user's would be: the driver forwards AWS_* to the workers
        with harness.ray_cluster(args.address):
            trials = harness.alternate(["local", "store"], args.repeats, lambda w, k: run(w, k, args, s3, local))
    page.write(body(args, trials), trials)


if __name__ == "__main__":
    sys.exit(main())
