"""Parameter server beside all-reduce, with and without a straggler:  python jobs/bench/bench_ps.py

Trains one job (model, corpus, workers, steps) under DDP and under every parameter-server mode (sync, sync with
a backup worker, async, Hogwild, EASGD) through `distrain.driver.launch.train` on one embedded Ray cluster on loopback,
then all of them again with the last rank --slowdown times slower (`fault.straggler`), the runs' order reversed
on every other repeat. Writes docs/ps.md from each run's metrics.jsonl and summary.json, and docs/ps.svg: loss
against step and against wall clock (its numbers in docs/ps.json: `--replot docs/ps.json` redraws it).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import harness  # first: it keeps Ray on loopback
from plots import figure  # jobs/bench/plots.py, beside this script

from distrain.config import OptimConfig
from distrain.testing import hosts

CONFIGS = {  # key → (label, overrides, colour)
    "ddp": ("DDP (all-reduce)", "strategy=ddp", "#222222"),
    "sync": ("PS sync", "strategy=ps", "#1f77b4"),
    "backup": ("PS sync + 1 backup", "strategy=ps ps.backup_workers=1", "#17becf"),
    "async": ("PS async", "strategy=ps ps=async", "#d62728"),
    "hogwild": ("PS Hogwild", "strategy=ps ps=hogwild", "#ff7f0e"),
    "easgd": ("PS EASGD", "strategy=ps ps=easgd", "#2ca02c"),
}
SCENARIOS = {"none": "no straggler", "straggler": "one straggler", "link": "two hosts over a slow link"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.parser(__doc__, "docs/ps.md", repeats=1, plot=True, cluster=True)
    p.add_argument("--steps", type=int, default=120, help="training steps per run (default 120)")
    p.add_argument("--workers", type=int, default=4, help="workers of every run (default 4)")
    p.add_argument("--eval-interval", type=int, default=20, help="validation every this many steps (default 20)")
    p.add_argument("--slowdown", type=float, default=3.0, help="the straggler's step time × (default 3)")
    p.add_argument("--target", type=float, default=2.5, help="the smoothed train loss to time (default 2.5)")
    p.add_argument("--smooth", type=int, default=5, help="steps of the moving mean of the loss (default 5)")
    p.add_argument("--timeout", type=float, default=900, help="seconds a run may take before it is stopped")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"a subset of {','.join(CONFIGS)}")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"a subset of {','.join(SCENARIOS)}")
    p.add_argument(
        "--link",
        default="20,100",
        help="scenario link: the one-way delay (ms) and rate (Mbit/s) between the two hosts (default 20,100)",
    )
    args = harness.parse(p, argv)
    args.configs, args.scenarios = args.configs.split(","), args.scenarios.split(",")
    args.delay_ms, args.mbit = map(float, args.link.split(","))
    if args.smoke:
        args.steps, args.workers, args.eval_interval, args.smooth = 6, 2, 3, 2
        args.configs, args.scenarios = ["sync"], ["straggler"]
    if args.workers < 2 or args.steps < 2 or not set(args.configs) <= set(CONFIGS):
        p.error(f"need --workers ≥ 2, --steps ≥ 2 and --configs from {','.join(CONFIGS)}")
    if not set(args.scenarios) <= set(SCENARIOS):
        p.error(f"--scenarios: choose from {','.join(SCENARIOS)}")
    args.link_skipped = "link" in args.scenarios and hosts.unavailable()
    if args.link_skipped:
        print(f"bench_ps: leaving out the link scenario: {args.link_skipped}", flush=True)
        args.scenarios.remove("link")
    return args


def overrides(args: argparse.Namespace, config: str, scenario: str, storage: Path, name: str) -> list[str]:
    """The Hydra overrides of one run: `python jobs/train.py <these>` trains the same job."""
    slow = f"fault.straggler={args.workers - 1} fault.straggler_slowdown={args.slowdown:g}"
    common = (
        f"model=nano cluster.num_workers={args.workers} trainer.max_steps={args.steps} "
        f"trainer.eval_interval={args.eval_interval} checkpoint.interval=0 run.storage={storage} run.name={name}"
    )
    # async and Hogwild apply every worker's gradient as its own update: the learning rate per update is
    # scaled down by the workers, as docs/parameter-server.md advises, for the step size per global batch of the others.
    lr = [f"optim.lr={OptimConfig().lr / args.workers:g}"] if config in ("async", "hogwild") else []
    # Across hosts: the workers spread over both (half on each) and a server on each.
    hosts = ["cluster.placement_strategy=SPREAD", "ps.num_servers=2"] if scenario == "link" else []
    return [
        *CONFIGS[config][1].split(),
        *common.split(),
        *harness.CPU_RUN,
        *(harness.TINY if args.smoke else []),
        *lr,
        *(slow.split() if scenario == "straggler" else []),
        *hosts,
    ]


def agg(fn: Callable[[list], float], values: list) -> float | None:
    """fn(values), None when there are none (a figure the strategy does not log)."""
    return fn(values) if values else None


def measure(args: argparse.Namespace, scenario: str, config: str, repeat: int, storage: Path, bed: Any) -> dict:
    """Train one configuration (stopped past --timeout s), on the two hosts of `bed` in the link scenario;
    what its metrics.jsonl and summary.json say."""
    run_overrides = overrides(args, config, scenario, storage, f"{scenario}-{config}-{repeat}")
    trained = harness.train(run_overrides, args.timeout, bed if scenario == "link" else None)
    run = {"config": config, "scenario": scenario, "error": trained.error}
    lines, summary = trained.metrics, trained.summary
    if len(lines) < 2:
        return run | {"error": run["error"] or "fewer than 2 metrics lines"}
    loss = [m["loss"] for m in lines]
    for i, m in enumerate(lines):
        m["smooth"] = statistics.fmean(loss[max(0, i + 1 - args.smooth) : i + 1])
    t0, span = lines[0]["time"], lines[-1]["time"] - lines[0]["time"]
    by_worker: dict[str, list[float]] = {}
    for m in lines:
        for w, rate in m.get("worker_steps_per_s", {}).items():
            by_worker.setdefault(w, []).append(rate)
    rates = sorted(statistics.median(r) for r in by_worker.values())
    column = lambda key: [m[key] for m in lines if key in m]  # noqa: E731
    return run | {
        "final_loss": summary.get("final_loss", loss[-1]), "final_val_loss": summary.get("final_val_loss"),
        "train_s": span, "wall_s": summary.get("wall_s"), "restarts": summary.get("restarts", 0),
        "steps_per_s": (lines[-1]["step"] - lines[0]["step"]) / span if span > 0 else None,
        "to_target_s": next((m["time"] - t0 for m in lines if m["smooth"] < args.target), None),
        "staleness_mean": agg(statistics.fmean, column("staleness_mean")),
        "staleness_max": agg(max, column("staleness_max")),
        "updates_per_s": agg(statistics.median, column("updates_per_s")), "dropped": agg(sum, column("dropped")),
        "mb_per_step": agg(statistics.fmean, [(m["bytes_pushed"] + m["bytes_pulled"]) / 1e6 for m in lines
                                              if "bytes_pushed" in m]),
        "worker_rates": (rates[0], rates[-1]) if rates else None,
        "curve": [(m["step"], m["time"] - t0, m["smooth"]) for m in lines],
    }  # fmt: skip


def merge(trials: list[harness.Trial]) -> dict:
    """One configuration's runs as one: each figure's median over the runs that have it, the first finished
    run's loss curve, the errors and restarts of any, and the load before each run."""
    runs = [t.result for t in trials]
    base = next((r for r in runs if "train_s" in r), runs[0])
    out = dict(base) | {"loads": [t.load for t in trials], "runs": len(runs)}
    for key, value in base.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = harness.median_of([r.get(key) for r in runs])
    if rates := [r["worker_rates"] for r in runs if r.get("worker_rates")]:
        out["worker_rates"] = (harness.median_of([a for a, _ in rates]), harness.median_of([b for _, b in rates]))
    out["error"] = "; ".join(dict.fromkeys(r["error"] for r in runs if r["error"])) or None
    out["restarts"] = sum(r.get("restarts", 0) for r in runs)
    return out


# -- the page ----------------------------------------------------------------------------------------


def name(run: dict) -> str:
    return CONFIGS[run["config"]][0]


def num(value: float | None, fmt: str = ".2f", unit: str = "") -> str:
    return "—" if value is None else format(value, fmt) + unit


def table(runs: list[dict], target: float) -> list[str]:
    head = [
        "configuration", "final train loss", "final val loss", "train s (first → last line)", "wall s (total)",
        "steps/s", "steps/s ÷ DDP", f"s to loss < {target:g}", "speed to target vs DDP", "staleness mean / max",
        "updates/s", "dropped grads", "MB pushed+pulled / step", "worker steps/s (slowest–fastest)", "load before",
    ]  # fmt: skip
    rows = []
    ddp = next((r for r in runs if r["config"] == "ddp" and "train_s" in r), {})
    for r in runs:
        if "train_s" not in r:
            rows.append([name(r), f"failed: {r['error']}", *[""] * (len(head) - 2)])
            continue
        ratio = r["steps_per_s"] / ddp["steps_per_s"] if ddp.get("steps_per_s") and r["steps_per_s"] else None
        speed = ddp["to_target_s"] / r["to_target_s"] if ddp.get("to_target_s") and r["to_target_s"] else None
        stale = f"{r['staleness_mean']:.2f} / {r['staleness_max']}" if r["staleness_mean"] is not None else "—"
        notes = [r["error"]] * bool(r["error"]) + [f"{r['restarts']} restart(s)"] * bool(r["restarts"])
        cells = [
            name(r) + "".join(f" ({n})" for n in notes), num(r["final_loss"], ".4f"), num(r["final_val_loss"], ".4f"),
            num(r["train_s"], ".1f"), num(r["wall_s"], ".1f"), num(r["steps_per_s"]), num(ratio, ".2f", "×"),
            num(r["to_target_s"], ".1f"), num(speed, ".2f", "×"), stale, num(r["updates_per_s"], ".1f"),
            num(r["dropped"], ".0f"), num(r["mb_per_step"]),
            "{:.2f}–{:.2f}".format(*r["worker_rates"]) if r["worker_rates"] else "—",
            ", ".join(f"{x:.2f}" for x in r["loads"]),
        ]  # fmt: skip
        rows.append(cells)
    return harness.table(head, rows)


def reading(runs: list[dict], target: float, steps: int, workers: int) -> str:
    """What the numbers say, from the numbers."""
    out, by = [], {(r["scenario"], r["config"]): r for r in runs if "train_s" in r}
    for scenario, title in SCENARIOS.items():
        if not (done := [r for (s, _), r in by.items() if s == scenario]):
            continue
        reached = sorted((r for r in done if r["to_target_s"] is not None), key=lambda r: r["to_target_s"])
        vals = sorted((r for r in done if r["final_val_loss"] is not None), key=lambda r: r["final_val_loss"])
        text = f"- **{title.capitalize()}.** "
        if reached:
            order = ", ".join(f"{name(r)} {r['to_target_s']:.1f} s" for r in reached)
            text += f"Smoothed train loss below {target:g}, soonest first: {order}. "
        if missed := [name(r) for r in done if r["to_target_s"] is None]:
            text += f"Never below {target:g}: {', '.join(missed)}. "
        if vals:
            text += f"Final val loss from {name(vals[0])} {vals[0]['final_val_loss']:.4f} to "
            text += f"{name(vals[-1])} {vals[-1]['final_val_loss']:.4f}. "
        if (d := by.get((scenario, "ddp"))) and (p := by.get((scenario, "sync"))):
            gap = abs(p["final_loss"] - d["final_loss"])
            text += f"PS sync ends {'at exactly' if gap == 0 else f'{gap:.2g} from'} DDP's final train loss (the "
            text += f"same averaged gradient each step) in {p['train_s'] / d['train_s']:.2f}× DDP's train time. "
        out.append(text.rstrip())
    cost = [(r, by.get(("none", c))) for (s, c), r in by.items() if s == "straggler"]
    if cost := [f"{name(r)} {r['train_s'] / base['train_s']:.2f}×" for r, base in cost if base]:
        out.append(
            "- **What the straggler costs** (train time with it ÷ without): " + ", ".join(cost) + ". A PS metrics "
            "line for step k is written once every worker has reported step k, and every worker but a dropped one "
            "computes every step of its slice, so in every mode the logged steps keep the slowest worker's pace; "
            "how far the others ran ahead shows in their own steps/s and in the server's updates/s."
        )
    pairs = [(r, by.get((s, "sync"))) for (s, c), r in by.items() if c in ("async", "hogwild")]
    if worse := [f"{name(r)} {SCENARIOS[r['scenario']]} {r['final_loss']:.3f} (sync {p['final_loss']:.3f})"
                 for r, p in pairs if p and r["final_loss"] > p["final_loss"]]:  # fmt: skip
        out.append(
            "- Final train loss above sync's: " + ", ".join(worse) + ". The server applies each worker's gradient "
            "(1/workers of the batch) on its own, at the learning rate ÷ workers: workers × as many updates as "
            "sync, each noisier and computed on older weights."
        )
    if drops := [f"{b['dropped']} of {steps * workers} ({SCENARIOS[s]})" for (s, c), b in by.items()
                 if c == "backup" and b["dropped"] is not None]:  # fmt: skip
        out.append(f"- Sync with one backup worker dropped {' and '.join(drops)} gradients.")
    if stale := [f"{name(r)} {SCENARIOS[s]} {r['staleness_mean']:.2f}" for (s, _), r in by.items()
                 if r["staleness_mean"] is not None]:  # fmt: skip
        out.append(f"- Mean staleness (server versions between a worker's pull and its push): {', '.join(stale)}.")
    return "".join(line + "\n" for line in out)


def plot_data(runs: list[dict], target: float, smooth: int) -> dict:
    """What the plot shows: each run's (step, seconds since its first line, smoothed loss), and the target."""
    curves = [{"scenario": r["scenario"], "config": r["config"], "curve": r["curve"]} for r in runs if "curve" in r]
    return {"target": target, "smooth": smooth, "runs": curves}


def draw(data: dict):  # noqa: ANN201  (a matplotlib Figure)
    """Smoothed loss against step and against wall clock, a row per scenario."""
    runs, target = data["runs"], data["target"]
    scenarios = {s: title for s, title in SCENARIOS.items() if any(r["scenario"] == s for r in runs)}
    fig, axes = figure(9.6, 0.8 + 3.2 * len(scenarios), len(scenarios), 2, sharey=True)
    fig.suptitle(f"Train loss ({data['smooth']}-step moving mean) per configuration", x=0.02, ha="left")
    for row, (scenario, title) in zip(axes, scenarios.items(), strict=True):
        for ax, (axis, unit) in zip(row, ((0, "step"), (1, "wall-clock s since the first step")), strict=True):
            for r in (r for r in runs if r["scenario"] == scenario):
                label, _, colour = CONFIGS[r["config"]]
                ax.plot([p[axis] for p in r["curve"]], [p[2] for p in r["curve"]], color=colour, lw=1.2, label=label)
            ax.axhline(target, color="#888", linestyle="--", linewidth=1, label=f"target {target:g}")
            ax.set_title(f"{title}: loss against {unit.split()[0]}", loc="left")
            ax.set_xlabel(unit)
            ax.set_xlim(left=0)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=4, frameon=False)
    return fig


def body(args: argparse.Namespace, runs: list[dict], plot: str) -> str:
    from distrain.driver.cli import compose
    from distrain.model.size import num_params

    cfg = compose(overrides(args, "easgd", "none", Path("/tmp"), "plan"))
    t, o, c, p, nl, sections = cfg.trainer, cfg.optim, cfg.cluster, cfg.ps, "\n", ""
    summary = reading(runs, args.target, args.steps, args.workers)
    link_note = (
        f"Two hosts over a slow link: each run's driver and Ray cluster on two hosts made of network namespaces on "
        f"this machine (`distrain/testing/hosts.py`: own addresses, veth pairs to a bridge), every packet between them "
        f"shaped on the bridge's ports: {getattr(args, 'link_applied', args.link)}; "
        f"`cluster.placement_strategy=SPREAD ps.num_servers=2`. The hosts still share this machine's cores: the "
        f"link is what differs."
        if "link" in args.scenarios
        else f"The slow-link scenario did not run: {args.link_skipped}."
    )
    extras = {
        "none": "",
        "straggler": f" (rank {args.workers - 1} at {args.slowdown:g}× its compute time per step)",
        "link": f" ({getattr(args, 'link_applied', args.link)}; half the workers and a server on each host)",
    }
    for scenario, title in ((s, SCENARIOS[s]) for s in args.scenarios):
        extra = extras[scenario]
        rows = table([r for r in runs if r["scenario"] == scenario], args.target)
        sections += f"## {title.capitalize()}{extra}\n\n{nl.join(rows)}\n\n"
    return f"""DDP (all-reduce) and each parameter-server mode (`strategy=ps`, `distrain/ps/`) train one job, one run
after the other through `distrain.driver.launch.train` on one embedded Ray cluster (loopback only), first with every
worker at full speed, then with one simulated straggler (`fault.straggler`); {args.repeats} run(s) of each, the order
reversed on every other repeat (a cell is the median over them, a curve the first run's).

- Job: `model={cfg.model.name}` ({num_params(cfg.model) / 1e6:.2f} M parameters), the default corpus
  (`data={cfg.data.name}`), {args.workers} CPU workers ({c.cpus_per_worker:g} CPU, {c.threads_per_worker} torch
  thread each), global batch {t.global_batch_size} × {t.seq_len} tokens, micro-batch {t.micro_batch_size}, fp32,
  {o.name} lr {o.lr:g} (async and Hogwild: {o.lr / args.workers:g}: one update per worker's gradient, so the lr per
  update is ÷ workers; {o.warmup_steps} warm-up steps, grad clip {o.grad_clip:g}), {t.max_steps} steps, validation
  every {t.eval_interval} steps ({t.eval_batches} batches) and after the last; `checkpoint.interval=0
  logger.wandb.mode=disabled`. PS: {p.num_servers} server (`ps.num_servers`), the presets' defaults otherwise
  (EASGD τ = {p.tau}, α = 0.9 / workers = {p.elastic_alpha(args.workers):g}).
- Columns: train s from the first to the last metrics line's `time`; wall s is `summary.json`'s `wall_s` (call
  → return: start-up, final validation and checkpoint included); steps/s over the train s; s to loss <
  {args.target:g}: the first line whose {args.smooth}-step trailing mean of the train loss is below it, from the
  first line; speed to target vs DDP: DDP's time ÷ this one's (> 1: sooner). PS figures from the metrics lines:
  mean `staleness_mean` / max `staleness_max`, median `updates_per_s` of the server, gradients `dropped` by the
  backup rounds, `bytes_pushed` + `bytes_pulled` per line, each worker's median `worker_steps_per_s`. Load before:
  the 1-minute load average before each run.
- A PS metrics line's `time` is when its step ended (the latest of the workers' records of that step); DDP's
  rank 0 writes each line as its step ends.

{sections}![smoothed loss against step and wall clock, per scenario]({plot})

## Reading

{summary}- This is CPU/gloo on loopback on a {harness.machine()["cores"]}-core machine: {args.workers}
  single-threaded workers, the server and the driver share the cores, so it measures orchestration and staleness
  effects (who waits for whom, what stale gradients do to the loss), not GPU performance: a sleeping straggler
  frees its core for the others, and every push and pull is a copy through Ray's object store.
- {link_note}
"""


@contextlib.contextmanager
def two_hosts(args: argparse.Namespace) -> Iterator[Any]:
    """For the link scenario: two hosts (network namespaces, distrain/testing/hosts.py) whose every packet to the other
    is delayed by --link's delay and limited to its rate (tc netem); removed at the end."""
    if "link" not in args.scenarios:
        yield None
        return
    bed = hosts.Bed(cpus_per_host=1)
    try:
        bed.add_host()
        bed.add_host()
        args.link_applied = bed.slow_link(args.delay_ms, args.mbit)
        yield bed
    finally:
        bed.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if harness.replot(args, draw):
        return
    page = harness.Page("Parameter server beside all-reduce", args)
    keys = [(scenario, config) for scenario in args.scenarios for config in args.configs]
    with harness.storage(args) as storage, harness.ray_cluster(args.address), two_hosts(args) as bed:
        trials = harness.alternate(
            keys,
            args.repeats,
            lambda key, k: measure(args, *key, k, storage, bed),
            lambda key: f"{SCENARIOS[key[0]]}: {CONFIGS[key[1]][0]}",
        )
    runs = [merge(mine) for mine in harness.by_key(trials).values()]
    order = {key: i for i, key in enumerate(keys)}
    runs.sort(key=lambda r: order[r["scenario"], r["config"]])
    for scenario in args.scenarios:
        print("\n" + "\n".join(table([r for r in runs if r["scenario"] == scenario], args.target)))
    page.write(body(args, runs, page.plot), trials, plot=(draw, plot_data(runs, args.target, args.smooth)))
    if failed := [r for r in runs if r["error"]]:
        raise SystemExit(f"bench_ps: {len(failed)} configuration(s) had problems: {failed[0]['error']}")


if __name__ == "__main__":
    main()
