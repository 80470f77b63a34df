"""What every benchmark shares, so that each jobs/bench/bench_*.py keeps only what it measures.

- **Environment.** Importing this module (before Ray) keeps Ray on loopback and quiet: the embedded
  cluster binds 127.0.0.1 only (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, which Ray reads when first
  imported), sends no usage statistics, and never attaches to a cluster named by `RAY_ADDRESS`.
- **Machine.** `machine()`, `describe()`, `commit()`, `off_loopback()`.
- **Runs.** `alternate()`: each configuration once per repeat, the order reversed on every other repeat
  (ABBA), the 1-minute load average taken before each run. `train()`: one distrain run through
  `distrain.driver.launch.train`, bounded in time, with what it wrote. `ray_cluster()`: one embedded cluster,
  or the one `--address` names (`parser(cluster=True)`); `ray_head()`: a cluster as `ray start --head` leaves one.
- Starting and ending processes (commands, bounded calls, gloo ranks) is distrain/testing/processes.py's.
- **Command line.** `parser()` with the options every benchmark has (--out, --repeats, --smoke,
  --storage), `parse()` (which keeps the exact command for the page), `storage()`.
- **Pages.** `Page` writes a page's header (title, command, commit, date, machine, loads), its body and
  its plots. `python jobs/bench/harness.py index` writes docs/benchmarks.md from the pages' headers.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import ipaddress
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from distrain.ports import free_ports
from distrain.testing import processes
from distrain.testing.processes import free_port, interrupt_after

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray is imported: bind 127.0.0.1 only
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ.pop("RAY_ADDRESS", None)  # an embedded cluster of this machine's, never one found in the environment
if "ray" in sys.modules:
    print("harness: imported after Ray: the embedded cluster may bind the external interface", file=sys.stderr)

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PROG = Path(sys.argv[0]).stem  # the benchmark running, for its console lines
# The overrides every CPU benchmark run shares: gloo, fp32, no W&B, a quiet console.
CPU_RUN = ["cluster.use_gpu=false", "trainer.precision=fp32", "logger.wandb.mode=disabled"]
CPU_RUN += ["logger.progress_interval_s=600"]
# --smoke's model: seconds, not minutes (the tests' tiny model).
TINY_MODEL = ["model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.ffn_dim=64"]
TINY = [*TINY_MODEL, "trainer.seq_len=32", "trainer.global_batch_size=8", "trainer.micro_batch_size=2"]


# -- the machine ----------------------------------------------------------------------------------


def machine() -> dict:
    """CPU, cores, GPUs, versions."""
    import torch

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "unknown",
    )
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "ray": version("ray"),
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = f"{torch.cuda.device_count()} × {torch.cuda.get_device_name(0)}"
        info["cuda"] = torch.version.cuda
    return info


def describe(info: dict) -> str:
    """The machine in one line: CPU, cores, GPUs; torch (CUDA), ray and Python versions."""
    cuda = f" (CUDA {info['cuda']})" if info.get("cuda") else ""
    return (
        f"{info['cpu']}, {info['cores']} cores, {info.get('gpu') or 'no GPU'}; "
        f"torch {info['torch']}{cuda}, ray {info['ray']}, Python {info['python']}"
    )


def load() -> float:
    """The 1-minute load average: other work on the machine skews CPU numbers most."""
    return os.getloadavg()[0]


def commit() -> tuple[str, bool]:
    """The commit checked out (short hash) and whether tracked files other than docs/ had uncommitted
    changes (the pages that benchmarks run before it wrote are not a change to what it measures)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs")
        return git("rev-parse", "--short", "HEAD"), bool(changed)
    except (OSError, subprocess.CalledProcessError):
        return "unknown", False


def off_loopback(placement: list[dict]) -> list[str]:
    """The addresses in a run's placement.json that are not loopback: benchmarks send nothing off the machine."""
    return sorted(
        {p["node_ip"] for p in placement if "node_ip" in p and not ipaddress.ip_address(p["node_ip"]).is_loopback}
    )


# -- runs -----------------------------------------------------------------------------------------


@dataclass
class Trial:
    """One run of one configuration."""

    key: Hashable
    repeat: int  # from 1
    position: int  # its place in its repeat's order, from 1
    load: float  # 1-minute load average just before it
    result: Any = None


def alternate(
    keys: Sequence[Hashable],
    repeats: int,
    run: Callable[[Hashable, int], Any],
    label: Callable[[Hashable], str] = str,
    quiet: bool = False,
) -> list[Trial]:
    """run(key, repeat) for every key, `repeats` times: in the order given on odd repeats, reversed on even
    ones (A B, B A, ...), so that a drift of the machine's load falls on every configuration alike."""
    trials = []
    for repeat in range(1, repeats + 1):
        order = list(keys) if repeat % 2 else list(keys)[::-1]
        for position, key in enumerate(order, 1):
            trial = Trial(key, repeat, position, load())
            if not quiet:
                print(f"{PROG}: repeat {repeat}/{repeats}: {label(key)} (load {trial.load:.2f}) ...", flush=True)
            trial.result = run(key, repeat)
            trials.append(trial)
    return trials


def by_key(trials: list[Trial]) -> dict[Hashable, list[Trial]]:
    """Each configuration's trials, in the order the keys first ran, repeats in order."""
    out: dict[Hashable, list[Trial]] = {}
    for t in sorted(trials, key=lambda t: t.repeat):
        out.setdefault(t.key, []).append(t)
    return out


def median_of(values: Sequence[float | None]) -> float | None:
    """The median of those that are there; None if none is."""
    have = [v for v in values if v is not None]
    return statistics.median(have) if have else None


def spread(values: Sequence[float], fmt: str = ".2f") -> str:
    """'median (min–max)', or the one value."""
    if not values:
        return "—"
    mid, lo, hi = statistics.median(values), min(values), max(values)
    return format(mid, fmt) + (f" ({lo:{fmt}}–{hi:{fmt}})" if format(lo, fmt) != format(hi, fmt) else "")


def read_json(path: Path, default: Any = None) -> Any:
    with contextlib.suppress(FileNotFoundError, ValueError):
        return json.loads(path.read_text())
    return default


@dataclass
class Trained:
    """One distrain run and what it wrote."""

    cfg: Any  # TrainConfig
    layout: Any  # distrain.strategy.layout.Layout
    summary: dict
    metrics: list[dict]
    error: str | None = None


def train(overrides: list[str], timeout_s: float = 1800.0, bed: Any = None) -> Trained:
    """`python jobs/train.py <overrides>`, in this process (on the cluster `ray_cluster` started), or as a
    driver on the head host of `bed` (distrain/testing/hosts.py): the config, its layout, summary.json and
    metrics.jsonl; a failure, a timeout or a worker off loopback (off the bed's own addresses) is in
    `error`."""
    from distrain.driver.cli import compose
    from distrain.driver.launch import train as launch
    from distrain.driver.validation import validate
    from distrain.storage.tracking import read_metrics

    cfg = compose(overrides)
    layout = validate(cfg)
    if bed is None:
        _, error = interrupt_after(timeout_s, lambda: launch(cfg))
    else:
        error = bed.train(overrides, timeout_s)
    run_dir = Path(cfg.run_dir)
    summary = read_json(run_dir / "summary.json", {})
    if summary.get("status") not in (None, "completed") and not error:
        error = f"status {summary['status']}"
    placed = read_json(run_dir / "placement.json", [])
    if off := [ip for ip in off_loopback(placed) if bed is None or ip not in bed.addresses]:
        error = f"ran off loopback: {off}"
    metrics = read_metrics(str(run_dir)) if (run_dir / "metrics.jsonl").exists() else []
    return Trained(cfg, layout, summary, metrics, error)


@contextlib.contextmanager
def ray_cluster(address: str | None = None, dashboard: bool = False) -> Iterator[None]:
    """One cluster for every run of a benchmark: `address`'s, or an embedded one on loopback. With
    `dashboard` (Ray Train's placement-group cleaner asks its state API) the dashboard runs on 127.0.0.1,
    named to every worker by RAY_API_SERVER_ADDRESS."""
    import ray

    from distrain.cluster.runtime import connect

    if dashboard and address is None:
        port = free_port()
        os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
        ray.init(address="local", include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=port)
    else:
        connect(address)
    try:
        yield
    finally:
        ray.shutdown()


AUTH = {"RAY_AUTH_MODE": "token"}  # a client of a `ray start` head sends its token (~/.ray/auth_token)


@contextlib.contextmanager
def ray_head(storage: Path, timeout_s: float = 120.0) -> Iterator[str]:
    """A running cluster, as `ray start --head` leaves one (token authentication, Ray's default): on
    127.0.0.1, with its own temp dir and ports, and one small job run on it already, so that no measured
    run pays for the cluster's first job; its GCS address. Ended by PID: its session."""
    temp_dir = tempfile.mkdtemp(prefix="rayb", dir="/tmp")  # short: Ray's socket paths are length-limited
    ports = ["node-manager", "object-manager", "dashboard-agent-listen", "dashboard-agent-grpc", "runtime-env-agent"]
    names = [*ports, "metrics-export", "ray-client-server"]
    port, *picked = free_ports(1 + len(names))
    ports, bin_dir = [f"--{name}-port={p}" for name, p in zip(names, picked, strict=True)], Path(sys.executable).parent
    cmd = [str(bin_dir / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}"]
    cmd += ["--include-dashboard=false", f"--temp-dir={temp_dir}", "--disable-usage-stats", *ports]
    log = storage / "ray-head.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    with open(log, "w") as out:
        head = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while "Ray runtime started" not in log.read_text():
            if head.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{PROG}: ray start --head did not come up:\n{log.read_text()[-2000:]}")
            time.sleep(0.5)
        first_job = f"import ray; ray.init(address='127.0.0.1:{port}'); ray.get(ray.remote(lambda: 0).remote())"
        done = processes.run_command([sys.executable, "-c", first_job], storage / "first-job.log", timeout_s, AUTH)
        if done.rc != 0:
            raise SystemExit(f"{PROG}: the first job on the head failed:\n{done.tail()}")
        yield f"127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(head.pid, signal.SIGTERM)  # `ray start --block` stops the node's processes
        head.wait()
        processes.reap(head.pid)
        shutil.rmtree(temp_dir, ignore_errors=True)


# -- the command line -----------------------------------------------------------------------------


def parser(doc: str, out: str, repeats: int, plot: bool = False, cluster: bool = False) -> argparse.ArgumentParser:
    """The options every benchmark has (and --replot, for one that draws a plot; --address, for one whose runs
    share one Ray cluster: `ray_cluster(args.address)`); a benchmark adds its own."""
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    p.add_argument("--out", default=out, help=f"the page, '' for none; plots go beside it (default {out})")
    if cluster:
        p.add_argument(
            "--address",
            default=None,
            help="a running Ray cluster (host:port of its GCS) to run on; default: an embedded one on loopback",
        )
    if plot:
        p.add_argument(
            "--replot",
            metavar="JSON",
            help="measure nothing: redraw the plot beside --out from the numbers a run wrote beside it (its .json)",
        )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"runs of each configuration, the order reversed on every other repeat (default {repeats}, smoke 1)",
    )
    p.add_argument("--smoke", action="store_true", help="a seconds-long run of every part, to check that it works")
    p.add_argument("--storage", default="", help="keep the runs' directories here (default: a temporary one)")
    p.set_defaults(default_repeats=repeats)
    return p


def parse(p: argparse.ArgumentParser, argv: list[str] | None = None, script: str = "") -> argparse.Namespace:
    """Parsed options, with `command`: the exact command line (of `script`, default the one running), as
    the page shows it."""
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    args.repeats = args.repeats or (1 if args.smoke else args.default_repeats)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    exe = os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT)) else sys.executable
    script = os.path.relpath(os.path.abspath(script or sys.argv[0]), ROOT)
    args.command = shlex.join([exe, script, *argv])
    return args


@contextlib.contextmanager
def storage(args: argparse.Namespace) -> Iterator[Path]:
    """Where the runs go: --storage, kept, or a temporary directory removed at the end."""
    if args.storage:
        Path(args.storage).mkdir(parents=True, exist_ok=True)
        yield Path(args.storage).resolve()
        return
    with tempfile.TemporaryDirectory(prefix=f"{PROG}_") as tmp:
        yield Path(tmp)


# -- pages ----------------------------------------------------------------------------------------

COMMIT_LINE = re.compile(r"^- Commit measured: `([^`]+)`( \(with uncommitted changes\))?; (.+?)\.$", re.MULTILINE)


class Page:
    """A benchmark's page. The header is the harness's: title, the exact command, the commit measured and
    the date, the machine, the load on it; then the benchmark's body, and its plots beside the page."""

    def __init__(self, title: str, args: argparse.Namespace, measures: bool = True):
        self.title, self.args = title, args
        self.commit, self.dirty = commit()
        self.date = time.strftime("%Y-%m-%d %H:%M %Z")
        self.info = machine() if measures else None
        self.load_at_start = load()

    def header(self, trials: Sequence[Trial] = ()) -> list[str]:
        lines = [f"# {self.title}", "", "```bash", self.args.command, "```", ""]
        dirty = " (with uncommitted changes)" if self.dirty else ""
        lines.append(f"- Commit measured: `{self.commit}`{dirty}; {self.date}.")
        if self.info is not None:
            lines.append(f"- Machine: {describe(self.info)}.")
            lines.append(f"- 1-minute load average: {self.loads(trials)}.")
        if getattr(self.args, "smoke", False):
            lines.append(
                "- **Smoke run** (`--smoke`): a tiny job cut to seconds to check that the benchmark works; its "
                "numbers measure nothing."
            )
        return [*lines, ""]

    def loads(self, trials: Sequence[Trial]) -> str:
        text = f"{self.load_at_start:.2f} at the start, {load():.2f} at the end"
        if trials:
            each = [t.load for t in trials]
            text += f", {min(each):.2f}–{max(each):.2f} before the {len(each)} runs (each run's in the tables)"
        return text + ". The machine may be shared: other work on its cores slows CPU runs down"

    @property
    def plot(self) -> str:
        """The file name of the page's plot, beside it: the page's own name, with .svg."""
        return Path(self.args.out or "plot.md").with_suffix(".svg").name

    def write(self, body: str, trials: Sequence[Trial] = (), plot: Plot | None = None) -> None:
        """The page at --out (nothing when it is ''), its plot (SVG) beside it, and the plot's numbers (JSON)."""
        if not self.args.out:
            return
        out = resolve(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        if plot is not None:
            draw, data = plot
            out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
            save_plot(out, draw, data)
        out.write_text("\n".join(self.header(trials)) + "\n" + body.strip() + "\n")
        print(f"{PROG}: wrote {out}" + (f" and {out.with_suffix('.svg')} (numbers: .json)" if plot is not None else ""))


Plot = tuple[Callable[[dict], Any], dict]  # a benchmark's draw function (→ a matplotlib Figure) and its numbers


def resolve(page: str) -> Path:
    out = Path(page)
    return out if out.is_absolute() else ROOT / out


def save_plot(page: Path, draw: Callable[[dict], Any], data: dict) -> None:
    import plots  # jobs/bench/plots.py: matplotlib, only where a plot is drawn

    page.with_suffix(".svg").write_text(plots.svg(draw, data))


def replot(args: argparse.Namespace, draw: Callable[[dict], Any]) -> bool:
    """With --replot FILE: the plot beside --out drawn again from FILE's numbers, and True (nothing to measure)."""
    if not args.replot:
        return False
    if not args.out:
        raise SystemExit(f"{PROG}: --replot draws the plot beside --out: give --out")
    out = resolve(args.out)
    save_plot(out, draw, json.loads(Path(args.replot).read_text()))
    print(f"{PROG}: drew {out.with_suffix('.svg')} from {args.replot}")
    return True


def table(head: Sequence[str], rows: Sequence[Sequence[object]], align: str = "") -> list[str]:
    """A markdown table; `align` has a character per column, 'l' (left) or 'r' (right: the default past the first)."""
    align = align or "l" + "r" * (len(head) - 1)
    rule = ["---:" if a == "r" else "---" for a in align]
    return ["| " + " | ".join(map(str, r)) + " |" for r in [head, rule, *rows]]


# -- the index ------------------------------------------------------------------------------------


def summary_line(script: Path) -> str:
    """The first line of a script's docstring, without the command after its colon."""
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    return doc.splitlines()[0].split(":  python ")[0].rstrip(".") if doc else ""


def index(docs: Path = DOCS) -> str:
    """docs/benchmarks.md's body: each benchmark, its page, and the commit and date the page names."""
    pages = {}
    for page in sorted(docs.glob("*.md")):
        text = page.read_text()
        script = re.search(r"jobs/(bench/)?(\w+)\.py", text)  # the first: the page's own command
        if page.name != "benchmarks.md" and script and script[1]:
            pages.setdefault(script[2], []).append((page.name, COMMIT_LINE.search(text)))
    rows = []
    for script in sorted((ROOT / "jobs" / "bench").glob("bench_*.py")):
        what, found = summary_line(script), pages.get(script.stem, [])
        for name, measured in found:
            when = "not recorded (written before the harness: rerun)"
            if measured:
                when = f"`{measured[1]}`{' + changes' if measured[2] else ''}, {measured[3]}"
            rows.append([f"`jobs/bench/{script.name}`", f"[{name}]({name})", when, what])
        if not found:
            needs = "no page: it needs a GPU, and none has run it yet" if "Needs a GPU" in script.read_text() else ""
            rows.append([f"`jobs/bench/{script.name}`", "—", needs or "no page yet", what])
    return "\n".join(
        [
            "Each benchmark is one command that writes its own page: the header names the command, the commit",
            "measured, the date, the machine and its load. Every one takes `--smoke` (a seconds-long run that",
            "checks it works; `tests/test_benchmarks.py` runs them all), `--out` (where the page goes),",
            "`--repeats` (runs of each configuration, in alternating order) and `--storage` (keep the runs).",
            "`jobs/bench/harness.py` holds what they share. This index is written by",
            "`python jobs/bench/harness.py index`.",
            "",
            *table(["benchmark", "page", "measured at", "what it measures"], rows, "llll"),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__, str(DOCS / "benchmarks.md"), 1)
    p.add_argument("what", choices=["index"], help="index: write docs/benchmarks.md from the pages' headers")
    args = parse(p, argv, script=__file__)
    page = Page("Benchmarks", args, measures=False)
    page.write(index(Path(args.out).resolve().parent if args.out else DOCS))


if __name__ == "__main__":
    main()
