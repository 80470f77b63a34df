"""Every benchmark in jobs/ runs in its --smoke mode and writes a page that names the commit it measured.

Each script runs as a command in a session of its own (`processes.run_command`: its log kept, a timeout,
every process it leaves ended by PID), its page under the test's tmp_path. The smoke runs use tiny
models, a few steps and 2 workers. Those whose runs share one Ray cluster (`--address`) attach to one that
`ray start --head` started on 127.0.0.1 for the module (`harness.ray_head`), as each would start and end an
embedded one of its own (seconds each on 2 cores); the embedded cluster, which harness keeps on 127.0.0.1, is
started by bench_ddp's runs (jobs/train.py, Ray Train's) and gpu_check's.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import free_port, rank_env, spawn_ranks

from distrain.testing import processes

REPO = Path(__file__).resolve().parent.parent
sys.path += [str(REPO / "jobs" / "bench"), str(REPO / "jobs")]  # the harness; gpu_check.py

import harness  # noqa: E402  (jobs/bench/harness.py)

# The benchmarks whose runs share one Ray cluster (`harness.parser(cluster=True)`: they take --address).
ATTACH = {
    "bench_strategies",
    "bench_ps",
    "bench_recovery",
    "bench_checkpoint",
    "bench_offload",
    "bench_storage",
    "bench_moe",
}


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A cluster on 127.0.0.1 as `ray start --head` leaves one, for the smoke runs in ATTACH; its address. A head
    that does not come up (its GCS not answering `ray start` in time, on a loaded machine) is started once more,
    as `runtime.connect` starts an embedded one once more."""
    with contextlib.ExitStack() as held:
        try:
            address = held.enter_context(harness.ray_head(tmp_path_factory.mktemp("ray-head")))
        except SystemExit as e:
            print(f"{e}\nstarting it once more")
            address = held.enter_context(harness.ray_head(tmp_path_factory.mktemp("ray-head")))
        yield address


def smoke(
    tmp_path: Path, script: str, timeout_s: float, *extra: str, address: str | None = None
) -> tuple[processes.Finished, Path]:
    """`python jobs/<script> --smoke --out <tmp_path>/<page>.md [--address <address>]`; its exit, and the page's
    path."""
    page = tmp_path / "docs" / f"{script.removeprefix('bench_')}.md"
    cmd = [sys.executable, f"jobs/bench/{script}.py", "--smoke", "--out", str(page)]
    cmd += ["--storage", str(tmp_path / "runs"), *(["--address", address] if address else [])]
    env = harness.AUTH if address else None
    done = processes.run_command([*cmd, *extra], tmp_path / f"{script}.log", timeout_s, env)
    assert done.rc == 0, f"{script} exited with {done.rc}:\n{done.tail(60)}"
    return done, page


def assert_page(page: Path, plot: bool = False) -> str:
    """The page is there, its header names the commit checked out and the smoke run, and so does the index."""
    text = page.read_text()
    commit, _ = harness.commit()
    measured = harness.COMMIT_LINE.search(text)
    assert measured and measured[1] == commit, text[:600]
    assert "--smoke" in text and "Smoke run" in text
    assert "- Machine: " in text and "- 1-minute load average: " in text
    if plot:  # matplotlib's SVG, linked from the page, and the numbers it was drawn from beside it
        svg = page.with_suffix(".svg")
        assert "<svg" in svg.read_text() and f"]({svg.name})" in text
        assert json.loads(page.with_suffix(".json").read_text())
    harness.main(["index", "--out", str(page.parent / "benchmarks.md")])
    index = (page.parent / "benchmarks.md").read_text()
    assert f"[{page.name}]({page.name}) | `{commit}`" in index, index
    return text


# script, seconds it may take, whether it draws a plot, what its page must hold
SMOKES = [
    # all three runners trained and did the same training (the Ray Train run a separate command, its own cluster)
    ("bench_ddp", 360, False, ["| distrain (Ray) |", "| torchrun |", "| Ray Train |", "| **Ray Train / torchrun** |"]),
    ("bench_strategies", 240, False, ["| ddp | 2 | dp_replicate 2 |", "| zero2 | 2 | dp_shard 2, ZeRO-2 |"]),
    ("bench_bubble", 180, True, ["| interleaved_zb | 2 |"]),
    ("bench_ps", 240, True, ["## One straggler", "| PS sync |"]),
    # the spare, warm at the kill, took the dead rank; the steps redone counted
    ("bench_recovery", 240, True, ["| distrain, from replicas, 2 workers | 1 |", "| yes |", "steps redone"]),
    # the three ways trained the same (one final loss each), the background's cost was computed, and the
    # step's wait per save read from the trainer's checkpoint_block_s
    (
        "bench_checkpoint",
        180,
        False,
        [
            "| background (`async=true`) |",
            "In the background the step waits",
            "a background checkpoint costs",
            "## GPU",
        ],
    ),
    # the grid's bytes were counted, and matched the theory's
    ("bench_tp", 180, True, ["| 2-D, 2×2 | 4 |", "| yes |"]),
    # every cp measured against the budget, and both modes timed
    ("bench_cp", 180, False, ["| cp 4 | ", "| ring (s) | all-to-all (s) |"]),
    # three tiers trained the same, NVMe under its memory bound, the disk measured beside the step
    ("bench_offload", 180, False, ["| `strategy=nvme` |", "within it", "identical step for step", "| overlapped |"]),
    # both storages trained the same, the store's resumed from its URL alone, a plain s3fs upload timed beside it
    ("bench_storage", 180, False, ["| the object store (SeaweedFS, loopback) |", "| the local disk |", "The upload: "]),
    # every layout timed beside the dense model; the clock saw the exchange's 5 all-to-alls per layer and
    # micro-batch (2 layers, 2 micro-batches); a curve for every balancing mode
    ("bench_moe", 90, True, ["| moe_nano | 2 | ", "| ep 2 | 20 |", "| aux_loss |", "| bias |", "| none |"]),
    # the checksum a commit reads files with, and every candidate it was chosen from
    ("bench_checksum", 60, False, ["| `integrity.checksum`: read + CRC-32 |", "| `hashlib.blake2b` |", "s per GB"]),
]


@pytest.mark.parametrize(
    "script, timeout_s, plot, holds",
    [pytest.param(*case, id=case[0], marks=pytest.mark.timeout(case[1] + 60)) for case in SMOKES],
)
def test_smoke(tmp_path: Path, script: str, timeout_s: float, plot: bool, holds: list[str], request) -> None:
    address = request.getfixturevalue("head") if script in ATTACH else None
    _, page = smoke(tmp_path, script, timeout_s, address=address)
    text = assert_page(page, plot)
    for expected in holds:
        assert expected in text, text


def muon_costs_rank(rank: int, port: int, cases: dict, out: str) -> None:
    """One gloo rank of muon_costs.py's measure (forked from the session's server: no interpreter to start)."""
    rank_env(rank, 4, port, CUDA_VISIBLE_DEVICES="")
    from distrain.parallel import process_group

    device = process_group.init_from_env()
    rows = importlib.import_module("muon_costs").measure(rank, device, cases)
    if rank == 0:
        Path(out, "rows.json").write_text(json.dumps(rows))
    process_group.destroy()


@pytest.mark.timeout(120)
def test_muon_costs_counts_the_theorys_bytes(tmp_path: Path) -> None:
    """jobs/bench/muon_costs.py's measure on a tiny model, Muon under ZeRO-3 (each matrix in 4 shards) and TP (in
    2): the bytes one optimizer step sends are its all-to-all theory's times the shards (gloo all-gathers), as
    docs/optimizers.md reads its table; both parts of the step timed."""
    muon_costs = importlib.import_module("muon_costs")
    tiny = ["model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.ffn_dim=64", "trainer.seq_len=16"]
    shards = {"zero3": 4, "tp": 2}
    cases = muon_costs.cases("muon", tiny, {name: muon_costs.LAYOUTS[name] for name in shards})
    spawn_ranks(muon_costs_rank, (free_port(), cases, str(tmp_path)), muon_costs.WORLD)
    rows = json.loads((tmp_path / "rows.json").read_text())
    for name, w in shards.items():
        row = rows[name]
        assert row["theory"] > 0 and row["sent"] == w * row["theory"], (name, row)
        assert all(s > 0 for s in row["seconds"]), (name, row)


PLOTS = {
    "bench_bubble": "bubble",
    "bench_ps": "ps",
    "bench_recovery": "recovery",
    "bench_tp": "tensor-parallel",
    "bench_moe": "moe",
}


@pytest.mark.parametrize("script, page", PLOTS.items(), ids=list(PLOTS))
def test_replot_draws_a_docs_plot_from_its_numbers(tmp_path: Path, script: str, page: str, capsys) -> None:
    """`--replot docs/<page>.json` redraws the page's plot from the numbers recorded beside it, measuring
    nothing: the figure's lines hold those numbers, and only the plot is written."""
    bench = importlib.import_module(script)
    data = json.loads((REPO / "docs" / f"{page}.json").read_text())
    bench.main(["--replot", str(REPO / "docs" / f"{page}.json"), "--out", str(tmp_path / f"{page}.md")])
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{page}.svg"]
    assert "<svg" in (tmp_path / f"{page}.svg").read_text() and "drew" in capsys.readouterr().out
    fig = bench.draw(data)
    drawn = [list(zip(line.get_xdata(), line.get_ydata(), strict=True)) for ax in fig.axes for line in ax.lines]
    bars = [(p.get_x(), p.get_width()) for ax in fig.axes for p in ax.patches]
    for expected in NUMBERS[page](data):
        assert expected in drawn or expected in bars, expected


NUMBERS = {  # page → what its figure must draw, from its numbers: a line's points, or a bar segment's (x, width)
    "bubble": lambda d: [
        [(int(m), v) for m, v in sorted(by_m.items(), key=lambda kv: int(kv[0]))] for by_m in d["idle"].values()
    ],
    "ps": lambda d: (
        [[(p[0], p[2]) for p in r["curve"]] for r in d["runs"]]
        + [[(p[1], p[2]) for p in r["curve"]] for r in d["runs"]]
    ),
    "recovery": lambda d: [(0.0, b["detect_teardown"]) for b in d["bars"]],
    "moe": lambda d: [list(zip(d["steps"], v, strict=True)) for by in d["modes"].values() for v in by.values()],
    "tensor-parallel": lambda d: [[(x["p"], x["sent_mib"]) for x in d["measured"] if x["mode"] == "3d" or x["p"] == 1]],
}


@pytest.mark.timeout(90)
def test_mfu_needs_a_gpu_outside_its_smoke(tmp_path: Path) -> None:
    """Without --smoke, on a machine without a GPU, bench_mfu says it needs one, exits 0 and writes no page (its
    smoke run is gpu_check's part, checked in test_gpu_check_cpu_mode)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    page = tmp_path / "gpu" / "mfu.md"
    cmd = [sys.executable, "jobs/bench/bench_mfu.py", "--out", str(page)]
    done = processes.run_command(cmd, tmp_path / "bench_mfu_gpu.log", 60)
    assert done.rc == 0 and "needs a GPU" in done.log.read_text()
    assert not page.exists() and not page.parent.exists()


def assert_mfu(page: Path, raw: Path) -> None:
    """bench_mfu's smoke: distrain, the plain loop and transformers each trained the job in one run, their ratios
    on the page; the plain loop, on distrain's model class with the same init, data and schedule, ended at
    distrain's loss."""
    import torch

    text = assert_page(page)
    variants = ["eager", "compiled"] if torch.cuda.is_available() else ["eager"]
    for variant in variants:
        for side in ("distrain", "plain loop", "transformers"):
            assert f"| {side}, {variant} | 1 | " in text, text
        assert f"| {variant} | **" in text and f"With {variant} blocks distrain runs at " in text, text
    runs = {(r["side"], r["variant"]): r for r in json.loads(raw.read_text())["runs"]}
    assert sorted(runs) == sorted((s, v) for s in ("distrain", "plain", "transformers") for v in variants)
    for variant in variants:
        assert runs["plain", variant]["final_loss"] == pytest.approx(runs["distrain", variant]["final_loss"], rel=0.01)


def test_gpu_check_walks_the_journey_by_default() -> None:
    """The checkpoint, SIGKILL → resume, export and generate parts (the journey, held in CPU mode below) are
    among the parts a plain `gpu_check.py` runs on a GPU, not an option to remember."""
    gpu_check = importlib.import_module("gpu_check")
    assert "journey" in gpu_check.parse_args([]).parts


@pytest.mark.timeout(540)
def test_gpu_check_cpu_mode(tmp_path: Path) -> None:
    """Without a GPU (hidden where there is one), jobs/gpu_check.py runs every part at tiny sizes, one worker
    in place of one GPU: those that fit pass, those that need more workers are skipped, and every page goes
    under --storage, none into docs/. The journey, for both model families: a rank SIGKILLed mid-run, the run
    resumed from a committed checkpoint (one restart in its summary.json) with the uninterrupted run's losses
    to the bit (CPU, fp32), exported and loaded by transformers with the same logits, and sampled."""
    import torch

    docs = {name: REPO / "docs" / name for name in ("gpu.md", "loss.md", "mfu.md", "collectives.md", "ring.md")}
    before = {name: path.stat().st_mtime_ns if path.exists() else None for name, path in docs.items()}
    cmd = [sys.executable, "jobs/gpu_check.py", "--storage", str(tmp_path)]
    cmd += ["--parts", ",".join(importlib.import_module("gpu_check").PARTS)]  # every one, the optional benchmarks too
    done = processes.run_command(cmd, tmp_path / "gpu_check.log", 480, env={"CUDA_VISIBLE_DEVICES": ""})
    log = done.log.read_text()
    assert done.rc == 0, done.tail(60)
    for part in ("ddp", "zero1", "zero2", "zero3", "offload", "nvme", "ps"):
        assert f"PASS  strategy {part} (1 CPU worker)" in log, log
    assert "SKIP  strategy tp " in log and "needs 2 CPU workers (tp 2)" in log and "needs 4 CPU workers" in log
    mfu, collectives = "MFU (jobs/bench/bench_mfu.py)", "collectives (jobs/bench/bench_collectives.py)"
    loss = "chunked loss (jobs/bench/bench_loss.py)"  # its smoke: the chunked step's peak below the whole one's
    float8 = "float8 (tensorwise) against bf16 (zero3, 1 rank)"  # emulated on the CPU
    ring = "ring attention's blocks (jobs/bench/bench_ring.py)"
    for part in ("bf16 against fp32 (ddp)", float8, loss, mfu, collectives, ring):
        assert f"PASS  {part} (" in log, log
    lines = {line.split(" (")[0]: line for line in log.splitlines() if line.startswith(("PASS", "FAIL", "SKIP"))}
    for model in ("nano", "gpt2_nano"):
        resume, export, generate = (f"PASS  journey {model}: {p}" for p in ("SIGKILL → resume", "export", "generate"))
        assert "equal to the bit of the uninterrupted run's" in lines.get(resume, ""), log
        assert "logits within" in lines.get(f"{export} → transformers", ""), log
        assert "32 characters after 'def '" in lines.get(f"{generate} on cpu", ""), log
        summary = harness.read_json(tmp_path / f"journey-{model}" / "summary.json")
        assert summary["status"] == "completed" and summary["restarts"] == 1, summary
        assert [a["outcome"] for a in summary["attempts"]] == ["failed", "completed"], summary
        assert summary["attempts"][1]["info"]["resumed_from_step"] in (4, 8), summary  # committed before step 10
    assert "SKIP  a sticky CUDA error leaves the worker unreused" in log and "needs a GPU" in log
    assert "20 passed, 0 failed, 11 skipped" in log and "are still to be taken" in log
    assert "PASS  moe_nano, ep 1 (1 CPU worker)" in log and "× the mean" in lines.get("PASS  moe_nano, ep 1", ""), log
    assert all(f"SKIP  strategy {grid} " in log for grid in ("tp2d", "tp2p5d", "tp3d"))  # 4 and 8 workers
    assert "SKIP  strategy cp " in log and "needs 2 CPU workers (cp 2)" in log
    assert {name: path.stat().st_mtime_ns if path.exists() else None for name, path in docs.items()} == before
    page = (tmp_path / "docs" / "gpu.md").read_text()
    assert f"; torch {torch.__version__}" in page  # the header names the torch (and on a GPU its CUDA) it ran on
    assert "| zero3 | 1 | 1 rank |" in page and "| bf16 against fp32 (ddp) | **PASS** |" in page
    assert "| journey gpt2_nano: export → transformers | **PASS** |" in page and "## The journey" in page
    # The two benchmarks it runs in their smoke mode, checked here rather than run twice.
    collectives = assert_page(tmp_path / "docs" / "collectives.md")
    assert "## Against torch.distributed without Ray" in collectives and "| all_reduce | " in collectives
    assert "## all_reduce (busbw factor 1)" in collectives  # 2 ranks: 2(n − 1)/n = 1
    assert_mfu(tmp_path / "docs" / "mfu.md", tmp_path / "bench_mfu.json")
    assert "| 512 | " in assert_page(tmp_path / "docs" / "ring.md")  # every length measured, the ring beside sdpa


@pytest.mark.timeout(30)
def test_index_of_pages(tmp_path: Path) -> None:
    """The index lists every benchmark, with the commit and date its page names, or says why there is none."""
    page = "# DDP\n\n```bash\njobs/bench/bench_ddp.py\n```\n\n- Commit measured: `abc1234`; now.\n"
    (tmp_path / "ddp.md").write_text(page)
    (tmp_path / "ps.md").write_text("# PS, as written before the harness\n\n    jobs/bench/bench_ps.py\n")
    harness.main(["index", "--out", str(tmp_path / "benchmarks.md")])
    index = (tmp_path / "benchmarks.md").read_text()
    assert harness.COMMIT_LINE.search(index)[1] == harness.commit()[0]
    assert "| `jobs/bench/bench_ddp.py` | [ddp.md](ddp.md) | `abc1234`, now |" in index
    assert "| `jobs/bench/bench_ps.py` | [ps.md](ps.md) | not recorded" in index
    assert "| `jobs/bench/bench_mfu.py` | — | no page: it needs a GPU" in index
    assert "| `jobs/bench/bench_recovery.py` | — | no page yet |" in index
