"""The GPU figures and the user's journey in one command:  python jobs/gpu_check.py  (make gpu-check)

On a machine with G ≥ 1 GPUs (`torch.cuda.device_count()`) it runs, one console line per part (PASS, FAIL
or SKIP, and its figure), then a summary, and exits 1 if any part failed. `--parts` picks them (default:
strategies, journey, ps, sticky, moe, loss; the benchmarks mfu, collectives and ring are optional, minutes of
their own):

1. **strategies**: a short NCCL run of every preset in conf/strategy/ that fits on G GPUs, through
   distrain's own driver (`distrain.driver.launch.train`, what `python jobs/train.py` runs): `model=nano`, 20
   steps, `trainer.precision=bf16`. Each gets the most workers ≤ G its layout accepts; tp, pp, hsdp,
   fsdp_tp, cp and cp_alltoall (context parallel: the ring's isend/irecv and Ulysses' all-to-all on NCCL)
   need 2, 3d and tp2d 4, tp2p5d and tp3d 8, and a preset that needs more than G is skipped, saying so.
   Their degrees are not lowered to fit: at tp=1, pp=1 or dp_shard=1 a preset runs ddp's or zero3's code,
   not its own. NVMe offload is one of them (`strategy=nvme`). It passes when every logged
   loss is finite and the last is below the first.
2. **bf16 against fp32** (with 1): ddp's run again in fp32, on the same seed, data and workers. It passes
   when the final losses are within 2% of each other (relative). bf16 autocast rounds every matmul input to
   8 mantissa bits (0.4%), so the curves drift apart a little: over 20 steps of the nano model they stayed
   within 0.7% at every step and 0.01% at the last (CPU autocast, fp32 weights either way). A broken
   mixed-precision path (weights or gradients kept in bf16, a cast lost) moves the loss by far more.
   **float8 against bf16** (with 1): zero3's run again with `trainer.float8=tensorwise` (torchao's float8
   matmuls in the blocks; FSDP2 all-gathers their weights in float8 on 2 or more GPUs). It passes when the final
   losses are within 2% (relative): e4m3 keeps 3 mantissa bits (6% a value), averaged over each matmul's sums
   and the loss's tokens (tests/test_float8.py: 3 steps within 2% on the CPU). On a GPU below compute
   capability 8.9 the run must be refused in one line instead, which passes. CPU mode emulates the matmuls.
3. **journey**: what a user does, for every model preset in conf/model/ whose training fits one GPU (plan's
   memory estimate within 80% of its memory; --models names others), both families (Llama, GPT-2), ddp
   on G GPUs at the trainer's default precision (bf16 on CUDA), 12 steps:
   - **SIGKILL → resume**: background checkpoints (`checkpoint.async=true`) at steps 4 and 8; the last rank
     SIGKILLs its own process after step 10 (`fault.kill_at_step`: a kill at a known step, which a fast
     run cannot outrun, in the run's first attempt only); the supervisor restarts the run from the newest
     committed checkpoint (4, or 8 once its background write has committed) and it completes. It passes
     on exactly one restart, after the kill, from a checkpoint before it, with the loss at every step
     within a tolerance of an uninterrupted run of the same config. On the CPU (fp32) the tolerance is 0:
     the resumed run repeats the same arithmetic in the same order, so its losses are equal to the bit, as
     tests/test_fault_tolerance.py holds. On CUDA (bf16) it is 1% (relative, at each step): the weights,
     optimizer state, data position and RNG are restored exactly, but CUDA kernels are not bitwise
     reproducible run to run (atomic adds in the embedding's backward, the reduction order a matmul
     algorithm picks), and bf16 magnifies each such difference to its own rounding, 0.4%; part 2 bounds the
     whole of bf16's drift from fp32 at 0.7% per step over 20 steps, so two bf16 runs stay well within 1%.
     A broken resume (optimizer moments lost, a batch replayed or skipped, the schedule restarted) moves
     an early step's loss by several percent. The figure names the largest difference seen.
   - **export → transformers**: `jobs/export.py` on the run; `transformers` loads the directory and its
     logits on the same tokens match distrain's model from the same checkpoint within 1e-5 times the
     largest logit (at least 1; fp32 on the CPU both), the tolerance tests/test_hf.py holds at tiny sizes.
   - **generate**: `jobs/generate.py` on the run, greedy, 32 tokens on CUDA: it passes when it continues
     the prompt.
   Each preset's checkpoints and export are removed once checked: llama_1b's (12 GB a checkpoint) would
   otherwise fill the disk.
4. **ps**: `strategy=ps` (sync parameter server) on G GPU workers, `model=nano`: it passes as a strategy
   does, and when every worker was given a GPU, which it trains on: a parameter-server worker chooses its
   device through `process_group.device_for`, as a collective rank does, and fails in one line if its
   torch cannot use the GPU Ray gave it (tests/test_gpu_path.py).
5. **sticky**: a worker given a GPU passes the health check the supervisor runs on a rank after a failure
   (`process_group.check_device`), then writes far out of bounds on the device (issue 14's recipe: an
   illegal address, which leaves the process's CUDA context unusable for good); it passes when the check
   then fails and the group kills the worker instead of keeping it for the next attempt.
6. **moe**: `model=moe_1b` (2.5B parameters, 0.64B active: 16 experts, top-2 and a shared one) on the GPUs in
   bf16, its experts split over them (`strategy.ep`, when more than one divides them): it passes as a strategy
   does; the figure gives tokens/s, MFU counted on the active parameters (the weights a token passes through,
   as DeepSeek and torchtitan count a sparse model's) and the busiest expert's load ÷ the mean at the last
   step. On a GPU of compute capability ≥ 9.0 it also needs the experts' grouped matmul (`torch._grouped_mm`, the
   bf16 path `model/moe.grouped_linear` takes there) through a LoRA expert's rank-8 adapter and back to within 1%
   of the same in fp32, one matmul per expert (the CPU's path). CPU mode: `moe_nano` at the tests' tiny size.
7. **loss**: jobs/bench/bench_loss.py, one training step of a narrow Llama with a 128k vocabulary on 2048 tokens,
   the head and loss whole and chunked (`trainer.loss_chunk`), each in a fresh process: writes docs/loss.md. It
   passes when the chunked step's peak memory (torch.cuda.max_memory_allocated) is below the whole one's and the
   losses agree within 1e-6 (relative).
8. **MFU** (optional): jobs/bench/bench_mfu.py, llama_1b in bf16 with compiled blocks, distrain beside a plain
   PyTorch loop and transformers (the ratios are reported), and distrain in float8 (`trainer.float8=tensorwise`):
   writes docs/mfu.md. It passes when distrain's best run reaches the goal, ≥ 50% MFU (set for one H100), and
   float8 ≥ 1.2× its compiled bf16 tokens/s (where the GPU has float8).
9. **collectives** (optional): jobs/bench/bench_collectives.py on every GPU (NCCL), against torch.distributed's
   plain processes on the same GPUs (--repeats passes of each, alternating): writes docs/collectives.md.
   It passes when every operation's bandwidth ratio is ≥ 0.95; on one GPU, where nothing crosses a link,
   the ratio is only reported.
10. **ring** (optional): jobs/bench/bench_ring.py, ring attention's blocks (cp 4, each the fused kernel sdpa
   picks, merged) on one GPU against sdpa on the whole sequence, 16k to 64k tokens in bf16: writes docs/ring.md.
   It passes when the output and gradients are within bf16's rounding of the whole's; the time and memory
   ratios are reported.

It writes docs/gpu.md (--out); every page's header names the GPU, torch and its CUDA. The benchmarks run as
commands of their own, so their pages name their own command and each finds the GPU free.

The budget, under the 10 minutes one command may take: parts 1 to 5 measured on one H200 (2026-11-28,
docs/gpu.md), collectives on one H100 (2026-11-24):

| part                                                                   | seconds |
| ---------------------------------------------------------------------- | ------: |
| 1. Ray's start and ddp at 1 worker (CUDA, NCCL), 20 steps              |      18 |
| 1. zero1, zero2, zero3, offload, nvme at 1 worker, kept warm           |      14 |
| 2. ddp in fp32                                                         |       2 |
| 2. zero3 in float8 (not yet measured on a GPU)                         |       — |
| 3. journey nano, gpt2_nano: 2 runs, a new worker after the kill        |      32 |
| 3. journey llama_124m, gpt2_124m: the same, 2 GB checkpoints           |      86 |
| 3. journey llama_1b: the same, 12 GB checkpoints, 4 GB export          |     222 |
| 4. ps at 1 worker, its server                                          |      13 |
| 5. sticky: one fresh GPU worker                                        |       5 |
| 6. moe: moe_1b, 20 steps (not yet measured on a GPU)                   |       — |
| 7. loss: bench_loss, 2 fresh processes (not yet measured on a GPU)     |       — |
| total by default (without moe)                                         |     406 |
| 8. optional: bench_mfu, 6 runs of llama_1b × 30 steps (3 sides × 2)    |     330 |
| 8. and distrain in float8, 2 runs more (not yet measured on a GPU)     |       — |
| 9. optional: bench_collectives, 1 KB–256 MB, 2 passes of each side     |     184 |
| 10. optional: bench_ring, 16k–64k tokens, 5 passes (not yet measured)  |       — |

Without a GPU it runs in CPU mode, which checks that the scripts work: the same parts at tiny sizes (the
tests' tiny model, 8 steps, 12 for the journey, whose presets are nano and gpt2_nano; gloo; --workers CPU
workers in place of GPUs, default 1 as on one H100; bf16 is CPU autocast; generate on the CPU; sticky is
skipped), the benchmarks' --smoke, and every page under the storage directory's docs/ (temporary unless
--storage), never docs/. The figures are then still to be taken on a GPU, which it says. --smoke does the
same on a GPU machine, on its GPUs.

On a GPU machine torch must be a CUDA build: from a fresh clone, `make gpu-check TORCH=torch` installs it
(the Makefile's TORCH; an existing .venv keeps the build it has).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))  # the benchmarks' harness: its page, its runs
import harness  # noqa: E402  first: it keeps Ray on loopback

from distrain.testing import processes  # noqa: E402

if TYPE_CHECKING:
    from distrain.config import TrainConfig

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "offload", "nvme", "tp", "pp", "hsdp", "fsdp_tp", "3d")
STRATEGIES += ("tp2d", "tp2p5d", "tp3d")  # 4 and 8 GPUs
STRATEGIES += ("cp", "cp_alltoall")  # 2 GPUs
PARTS = ("strategies", "journey", "ps", "sticky", "moe", "loss", "mfu", "collectives", "ring")
DEFAULT_PARTS = PARTS[:6]  # the last three benchmarks take minutes of their own: --parts names them
TOLERANCE = 0.02  # bf16's final loss against fp32's, and float8's against bf16's, relative
FLOAT8 = "tensorwise"  # the recipe part 2 runs: the one whose weights FSDP2 all-gathers in float8
MOST_WORKERS = 64  # how far to look for the worker count a preset needs
RUN = ["checkpoint.interval=0", "trainer.eval_interval=0", "trainer.eval_batches=1", "cluster.reuse_workers=true"]
RUN += ["logger.wandb.mode=disabled", "logger.progress_interval_s=600", "optim.warmup_steps=5"]
# The journey: background saves at steps 4 and 8 (the save at 8 first waits for 4's commit), the kill after
# step 10, so that the restart resumes from a committed checkpoint with steps to redo; the end at 12.
JOURNEY_STEPS, INTERVAL, KILL_AT = 12, 4, 10
JOURNEY_RUN = ["checkpoint.async=true", f"checkpoint.interval={INTERVAL}", "checkpoint.keep=1"]
JOURNEY_RUN += [f"fault.kill_at_step={KILL_AT}", "cluster.restart_backoff_s=0"]
JOURNEY_RUN += ["cluster.peer_recovery=false"]  # the checkpoint restart (from replicas: test_peer_recovery)
RESUME_TOLERANCE = {"cpu": 0.0, "cuda": 0.01}  # the resumed run's loss at each step against the uninterrupted one's
LOSS_CHUNK_TOLERANCE = 1e-6  # the chunked loss against the whole one, relative
LOGITS_TOLERANCE = 1e-5  # the export's logits against distrain's, in fp32, times the largest logit (at least 1)
MEMORY_SHARE = 0.8  # of a GPU's memory, at most, that plan's estimate of a preset's training may take
PROMPT, NEW_TOKENS = "def ", 32
CPU_MODELS = ("nano", "gpt2_nano")  # CPU mode's journey: both families, at the tests' tiny sizes


@dataclass
class Part:
    name: str
    status: str  # PASS | FAIL | SKIP
    figure: str
    seconds: float = 0.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.parser(__doc__, "docs/gpu.md", repeats=2)
    p.add_argument("--steps", type=int, default=20, help="training steps of each strategy run (default 20, CPU 8)")
    p.add_argument("--workers", type=int, default=1, help="CPU mode: CPU workers in place of GPUs (default 1)")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="presets to run (default: all but ps)")
    p.add_argument(
        "--parts", default=",".join(DEFAULT_PARTS), help=f"of {','.join(PARTS)} (default: all but the last 3)"
    )
    p.add_argument(
        "--models", default="", help="model presets the journey walks (default: all that fit; CPU: nano,gpt2_nano)"
    )
    args = harness.parse(p, argv)
    import torch

    args.gpus = torch.cuda.device_count()
    if not args.gpus:
        args.smoke = True
    if args.smoke:
        args.steps = min(args.steps, 8)
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    args.parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    args.models = [s.strip() for s in args.models.split(",") if s.strip()]
    if args.steps < 2 or args.workers < 1:
        p.error("--steps must be at least 2 and --workers at least 1")
    if unknown := set(args.parts) - set(PARTS):
        p.error(f"--parts: no part {', '.join(sorted(unknown))}; choose from {','.join(PARTS)}")
    return args


def plural(n: int, unit: str) -> str:
    return f"{n} {unit}{'' if n == 1 else 's'}"


def report(part: Part, began: float) -> Part:
    """The part's console line, with the seconds it took since `began`."""
    part.seconds = time.time() - began
    print(f"{part.status}  {part.name} ({part.seconds:.0f} s): {part.figure}", flush=True)
    return part


# -- 1 and 2: training runs ---------------------------------------------------------------------


def overrides(args: argparse.Namespace, storage: Path, model: str = "nano", steps: int = 0) -> list[str]:
    """What every training run shares (`python jobs/train.py <these>` trains the same thing)."""
    size = harness.TINY if args.smoke else []
    device = "cluster.use_gpu=true" if args.gpus else "cluster.use_gpu=false"
    return [f"model={model}", *size, f"trainer.max_steps={steps or args.steps}", device, *RUN, f"run.storage={storage}"]


def workers_for(name: str, common: list[str], most: int, unit: str) -> tuple[int | None, str]:
    """The most workers ≤ `most` preset `name`'s layout accepts; or None and what it needs."""
    from distrain.config import ConfigError
    from distrain.driver.cli import compose
    from distrain.driver.validation import validate

    cfg = compose([*common, f"strategy={name}", "run.name=plan"])

    def fits(n: int) -> bool:
        cfg.cluster.num_workers = n
        try:
            validate(cfg)
        except ConfigError:
            return False
        return True

    if fit := next((n for n in range(most, 0, -1) if fits(n)), None):
        return fit, ""
    s = cfg.strategy
    sizes = (("tp", s.tp), ("pp", s.pp), ("cp", s.cp), ("dp_shard", s.dp_shard))
    degrees = " × ".join(f"{k} {v}" for k, v in sizes if v > 1)
    need = next((n for n in range(most + 1, MOST_WORKERS + 1) if fits(n)), None)
    return None, f"needs {plural(need, unit) if need else f'more than {MOST_WORKERS}'} ({degrees})"


def train(common: list[str], name: str, workers: int, precision: str) -> harness.Trained:
    run = [f"strategy={name}", f"cluster.num_workers={workers}", f"trainer.precision={precision}"]
    return harness.train([*common, *run, f"run.name={name}-{precision}"], timeout_s=300)


def strategy_part(trained: harness.Trained, name: str, workers: int, unit: str) -> Part:
    losses = [m["loss"] for m in trained.metrics]
    label = f"strategy {name} ({plural(workers, unit)})"
    if trained.error or not losses:
        return Part(label, "FAIL", trained.error or "no step logged")
    curve = f"loss {losses[0]:.4f} → {losses[-1]:.4f} over {len(losses)} steps"
    if not all(math.isfinite(x) for x in losses):
        return Part(label, "FAIL", f"{curve}: not finite")
    if losses[-1] >= losses[0]:
        return Part(label, "FAIL", f"{curve}: not falling")
    return Part(label, "PASS", curve)


def agreement_part(bf16: harness.Trained, fp32: harness.Trained, label: str = "bf16 against fp32 (ddp)") -> Part:
    a, b = [m["loss"] for m in bf16.metrics], [m["loss"] for m in fp32.metrics]
    if bf16.error or fp32.error or not a or len(a) != len(b):
        return Part(label, "FAIL", bf16.error or fp32.error or "the runs logged different steps")
    final = abs(a[-1] - b[-1]) / b[-1]
    most = max(abs(x - y) / y for x, y in zip(a, b, strict=True))
    figure = (
        f"final loss {a[-1]:.4f} against {b[-1]:.4f}: {final:.3%} apart (tolerance {TOLERANCE:.0%}); "
        f"at most {most:.3%} at any step"
    )
    return Part(label, "PASS" if final <= TOLERANCE else "FAIL", figure)


def most_workers(args: argparse.Namespace) -> tuple[int, str]:
    """The GPUs, or in CPU mode the CPU workers in their place; and what to call them."""
    return (args.gpus, "GPU") if args.gpus else (args.workers, "CPU worker")


def training(args: argparse.Namespace, storage: Path) -> tuple[list[Part], list[str]]:
    """Parts 1 and 2: their lines, and their section of docs/gpu.md."""
    common = overrides(args, storage)
    most, unit = most_workers(args)
    parts, rows, done = [], [], {}
    for name in args.strategies:
        began = time.time()
        workers, need = workers_for(name, common, most, unit)
        if workers is None:
            parts.append(report(Part(f"strategy {name}", "SKIP", need), began))
            rows.append([name, "—", "skipped"])
            continue
        done[name] = train(common, name, workers, "bf16")
        parts.append(report(strategy_part(done[name], name, workers, unit), began))
        rows.append([name, workers, mesh(done[name])])
    began = time.time()
    workers, _ = workers_for("ddp", common, most, unit)
    bf16 = done.get("ddp") or train(common, "ddp", workers, "bf16")
    parts.append(report(agreement_part(bf16, train(common, "ddp", workers, "fp32")), began))
    began = time.time()
    workers, _ = workers_for("zero3", common, most, unit)
    parts.append(report(float8_part(common, done.get("zero3") or train(common, "zero3", workers, "bf16")), began))
    head = ["strategy", f"{unit}s", "mesh"]
    section = [
        "## Strategies",
        "",
        f"`python jobs/train.py {' '.join(common[:-1])} strategy=<name> cluster.num_workers=<n> "
        "trainer.precision=bf16`, each preset on the most workers its layout accepts (a preset that needs more "
        "is skipped). A run passes when every logged loss is finite and the last is below the first.",
        "",
        *harness.table(head, rows, "lrl"),
        "",
        f"bf16 against fp32: ddp's run again with `trainer.precision=fp32`, on the same seed, data and workers; "
        f"the final losses must agree within {TOLERANCE:.0%} (relative): bf16 autocast's rounding moves them "
        "far less, a broken mixed-precision path far more. float8 against bf16: zero3's run again with "
        f"`trainer.float8={FLOAT8}`, within {TOLERANCE:.0%} of it (a GPU below compute capability 8.9 must refuse "
        "it in one line).",
        "",
    ]
    return parts, section


def float8_part(common: list[str], bf16: harness.Trained) -> Part:
    """zero3's bf16 run again with trainer.float8: its final loss within TOLERANCE of bf16's; on a GPU below compute
    capability 8.9, refused in one line (distrain/strategy/float8.py)."""
    import torch

    from distrain.strategy.float8 import FP8_CAPABILITY

    label = f"float8 ({FLOAT8}) against bf16 (zero3, {mesh(bf16)})"
    run = ["strategy=zero3", f"cluster.num_workers={bf16.layout.world_size}", "trainer.precision=bf16"]
    float8 = harness.train([*common, *run, f"trainer.float8={FLOAT8}", "run.name=zero3-float8"], timeout_s=300)
    capability = torch.cuda.get_device_capability(0) if torch.cuda.is_available() else FP8_CAPABILITY
    if capability < FP8_CAPABILITY:
        refused = float8.error is not None and "needs float8 tensor cores" in float8.error
        return Part(label, "PASS" if refused else "FAIL", f"compute capability {capability}: {float8.error}")
    return agreement_part(float8, bf16, label)


def mesh(trained: harness.Trained) -> str:
    """The run's mesh, e.g. 'tp 2 × dp_shard 2'."""
    return " × ".join(f"{k} {v}" for k, v in trained.layout.sizes().items() if v > 1) or "1 rank"


# -- 5. the user's journey, 6. the parameter server, 7. a sticky CUDA error -------------------------------


def journey_models(args: argparse.Namespace, storage: Path, workers: int) -> tuple[list[str], list[Part]]:
    """The model presets the journey walks (--models, else every preset in conf/model/ whose training fits the
    GPU by plan's estimate; CPU mode: one of each family at the tests' tiny sizes), and a SKIP for each other."""
    from distrain.driver.cli import CONF_DIR, compose
    from distrain.driver.plan import human, rank_memory
    from distrain.driver.validation import validate

    if args.models or not args.gpus:
        return args.models or list(CPU_MODELS), []
    import torch

    have = torch.cuda.get_device_properties(0).total_memory
    models, skipped = [], []
    for preset in sorted(Path(CONF_DIR, "model").glob("*.yaml")):
        cfg = compose([*overrides(args, storage, preset.stem), f"cluster.num_workers={workers}", "run.name=plan"])
        need = rank_memory(cfg, validate(cfg), 0, "bf16").device_total
        if need <= MEMORY_SHARE * have:
            models.append(preset.stem)
        else:
            why = f"plan estimates {human(need)} per GPU, over {MEMORY_SHARE:.0%} of its {human(have)}"
            skipped.append(Part(f"journey {preset.stem}", "SKIP", why))
    return models, skipped


def journey(args: argparse.Namespace, storage: Path, model: str, workers: int) -> list[Part]:
    """Train with background checkpoints, SIGKILL a rank (its own process, at step KILL_AT: fault.kill_at_step),
    let the supervisor resume from the committed checkpoint to the end, and hold the losses to an
    uninterrupted run's; export the run, load it in transformers and hold its logits to distrain's; sample
    from it with jobs/generate.py. Its checkpoints and export are then removed: a large preset's fill a disk."""
    common = [*overrides(args, storage, model, JOURNEY_STEPS), "strategy=ddp", f"cluster.num_workers={workers}"]
    label = f"journey {model}"
    began = time.time()
    reference = harness.train([*common, f"run.name=journey-{model}-uninterrupted"], timeout_s=600)
    shutil.rmtree(Path(reference.cfg.run_dir, "checkpoints"), ignore_errors=True)
    killed = harness.train([*common, *JOURNEY_RUN, f"fault.kill_rank={workers - 1}", f"run.name=journey-{model}"], 600)
    parts = [report(resume_part(label, reference, killed, "cuda" if args.gpus else "cpu"), began)]
    out = storage / f"export-{model}"
    if parts[0].status == "PASS":
        began = time.time()
        parts.append(report(export_part(label, killed.cfg, out), began))
        began = time.time()
        parts.append(report(generate_part(label, killed.cfg, "cuda" if args.gpus else "cpu"), began))
    shutil.rmtree(Path(killed.cfg.run_dir, "checkpoints"), ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    return parts


def journey_section(args: argparse.Namespace, workers: int) -> list[str]:
    """docs/gpu.md's account of the journey: the commands it runs, and what each part holds."""
    run = [*overrides(args, Path("runs"), "<preset>", JOURNEY_STEPS)[:-1], "strategy=ddp"]
    run += [f"cluster.num_workers={workers}", *JOURNEY_RUN, f"fault.kill_rank={workers - 1}"]
    device = "cuda" if args.gpus else "cpu"
    return [
        "## The journey",
        "",
        f"For each preset: `python jobs/train.py {' '.join(run)} run.name=journey-<preset>`, and the same without "
        "the checkpoint and fault overrides as the uninterrupted run; then `python jobs/export.py "
        "run.name=journey-<preset> out=<dir>`, `transformers.AutoModelForCausalLM.from_pretrained(<dir>)`, and "
        f"`python jobs/generate.py run.name=journey-<preset> prompt='{PROMPT}' max_new_tokens={NEW_TOKENS} "
        f"temperature=0 device={device}`. The resumed run's loss must match the uninterrupted run's at every "
        f"step within {RESUME_TOLERANCE['cuda']:.0%} on CUDA in bf16 (kernels are not bitwise reproducible; the "
        "restored state is exact), to the bit on the CPU; the export's logits must match distrain's within "
        f"{LOGITS_TOLERANCE:g} × the largest logit (fp32). jobs/gpu_check.py's docstring says why.",
        "",
    ]


def resume_part(label: str, reference: harness.Trained, killed: harness.Trained, device: str) -> Part:
    """PASS: one restart, after the kill, from a checkpoint committed before it; the run completed; its loss at
    every step within RESUME_TOLERANCE[device] (relative) of the uninterrupted run's."""
    label += ": SIGKILL → resume"
    if reference.error or killed.error:
        return Part(label, "FAIL", f"uninterrupted run: {reference.error}" if reference.error else killed.error)
    attempts = killed.summary.get("attempts", [])
    resumed = attempts[-1]["info"].get("resumed_from_step") if attempts else None
    if killed.summary.get("restarts") != 1 or [a["outcome"] for a in attempts] != ["failed", "completed"]:
        causes = "; ".join(f"{a['outcome']}: {a.get('cause') or ''}" for a in attempts)
        return Part(label, "FAIL", f"{killed.summary.get('restarts')} restarts, not the one kill's: {causes}")
    if not resumed or resumed % INTERVAL or resumed >= KILL_AT:
        return Part(label, "FAIL", f"resumed from step {resumed}, not a checkpoint committed before step {KILL_AT}")
    ours, theirs = ({m["step"]: m["loss"] for m in t.metrics} for t in (killed, reference))
    if ours.keys() != theirs.keys():
        return Part(label, "FAIL", f"logged steps {sorted(ours)}, the uninterrupted run {sorted(theirs)}")
    most = max(abs(ours[k] - theirs[k]) / abs(theirs[k]) for k in theirs)
    figure = (
        f"rank killed after step {KILL_AT}, resumed from step {resumed}, completed; the loss at each of "
        f"{len(ours)} steps {'equal to the bit' if most == 0 else f'within {most:.3%}'} of the uninterrupted "
        f"run's (tolerance {RESUME_TOLERANCE[device]:.0%})"
    )
    return Part(label, "PASS" if most <= RESUME_TOLERANCE[device] else "FAIL", figure)


def export_part(label: str, cfg: TrainConfig, out: Path) -> Part:
    """`python jobs/export.py` on the run; PASS when transformers loads the directory and its logits on the
    same tokens match distrain's own model from the same checkpoint (both fp32, on the CPU)."""
    import export  # jobs/export.py, beside this job
    import torch

    from distrain.driver.trained import load_trained

    label += ": export → transformers"
    try:
        import transformers
    except ImportError:
        return Part(label, "FAIL", "transformers is not installed: pip install -e '.[hf]' (make setup does)")
    try:
        export.main([f"run.name={cfg.run.name}", f"run.storage={cfg.run.storage}", f"out={out}"])
    except SystemExit as e:
        return Part(label, "FAIL", f"jobs/export.py exited with {e.code} (its line above)")
    _, ours = load_trained(cfg.run_dir)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.trainer.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = ours(x)
        most = (logits - theirs(x).logits).abs().max().item()
    bound = LOGITS_TOLERANCE * max(1.0, logits.abs().max().item())
    figure = f"{type(theirs).__name__}'s logits within {most:.1e} of distrain's (tolerance {bound:.1e})"
    return Part(label, "PASS" if most <= bound else "FAIL", figure)


def generate_part(label: str, cfg: TrainConfig, device: str) -> Part:
    """`python jobs/generate.py` on the run, greedy, on `device`; PASS when it continues the prompt."""
    import generate  # jobs/generate.py, beside this job

    label += f": generate on {device}"
    argv = [f"run.name={cfg.run.name}", f"run.storage={cfg.run.storage}", f"prompt={PROMPT}"]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            generate.main([*argv, f"max_new_tokens={NEW_TOKENS}", "temperature=0", f"device={device}"])
    except SystemExit as e:
        return Part(label, "FAIL", f"jobs/generate.py exited with {e.code} (its line above)")
    text = printed.getvalue().removesuffix("\n")
    new = text.removeprefix(PROMPT) if text.startswith(PROMPT) else ""
    figure = f"{len(new)} characters after {PROMPT!r} ({NEW_TOKENS} tokens asked): {new[:40]!r}"
    return Part(label, "PASS" if new else "FAIL", figure)


def ps_part(args: argparse.Namespace, storage: Path) -> Part:
    """strategy=ps on every GPU (CPU workers in CPU mode); PASS as a strategy passes and, on GPUs, when every
    worker was given one, which it must train on (process_group.device_for, through the learner: or the run
    fails in one line)."""
    workers, unit = most_workers(args)
    run = harness.train([*overrides(args, storage), "strategy=ps", f"cluster.num_workers={workers}", "run.name=ps"])
    part = strategy_part(run, "ps", workers, unit)
    placed = [e for e in harness.read_json(Path(run.cfg.run_dir, "placement.json"), []) if "rank" in e]
    if part.status == "PASS" and args.gpus:
        if not placed or not all(e.get("gpu_ids") for e in placed):
            return Part(part.name, "FAIL", f"{part.figure}; a worker was given no GPU: {placed}")
        part.figure += "; every worker on a GPU of its own"
    return part


def moe_part(args: argparse.Namespace, storage: Path) -> Part:
    """moe_1b (CPU: moe_nano, tiny) on every GPU, its experts split over them where they divide: PASS as a strategy
    passes; the figure adds tokens/s, MFU on the active parameters and the last step's load imbalance."""
    workers, unit = most_workers(args)
    model = "moe_1b" if args.gpus else "moe_nano"
    ep = workers if workers > 1 and 16 % workers == 0 else 1  # moe_1b's 16 experts (moe_nano's 8: any that divides)
    run = [f"strategy.ep={ep}", f"cluster.num_workers={workers}", "trainer.precision=bf16", "run.name=moe"]
    trained = harness.train([*overrides(args, storage, model), *run], timeout_s=600)
    part = strategy_part(trained, model, workers, unit)
    part.name = f"{model}, ep {ep} ({plural(workers, unit)})"
    if part.status == "PASS":
        last = trained.metrics[-1]
        busiest = max(v for k, v in last.items() if k.startswith("moe_imbalance_"))
        mfu = f", MFU {last['mfu']:.1%} on active parameters" if "mfu" in last else ""
        part.figure += f"; {last['tokens_per_s']:,.0f} tokens/s{mfu}; busiest expert {busiest:.2f}× the mean"
    if part.status == "PASS" and args.gpus:
        worst = grouped_against_loop()
        part.figure += f"; grouped matmul with a rank-8 adapter {'n/a' if worst is None else f'{worst:.1e}'} of fp32's"
        part.status = "FAIL" if worst is not None and worst > 0.01 else part.status
    return part


def grouped_against_loop() -> float | None:
    """An expert adapter's two grouped matmuls (x Aᵀ Bᵀ per expert: A (4, 8, 256), B (4, 512, 8), uneven rows, one
    expert with none) in bf16 against one fp32 matmul per expert: the largest difference over the largest value;
    None where torch takes no grouped matmul on this GPU."""
    import torch

    from distrain.model.moe import grouped_linear, grouped_mm_usable

    g = torch.Generator("cuda").manual_seed(0)
    x, a, b = (torch.randn(*s, device="cuda", generator=g) for s in ((64, 256), (4, 8, 256), (4, 512, 8)))
    counts = torch.tensor([5, 0, 37, 22], device="cuda")
    if not grouped_mm_usable(x.bfloat16()):
        return None
    got = grouped_linear(grouped_linear(x.bfloat16(), a.bfloat16(), counts), b.bfloat16(), counts).float()
    want = grouped_linear(grouped_linear(x, a, counts), b, counts)
    return float((got - want).abs().max() / want.abs().max())


def poison_the_device(channel: object) -> None:
    """In a worker given a GPU: a write far out of bounds, an illegal address that leaves the process's CUDA
    context unusable for good (a sticky error; issue 14's recipe)."""
    import torch

    x = torch.zeros(1, device="cuda")
    x[torch.tensor([1 << 40], device="cuda")] += 1
    torch.cuda.synchronize()


def sticky_part(args: argparse.Namespace) -> Part:
    """A worker on a GPU passes the health check the supervisor runs after a failure (process_group.check_device),
    raises a sticky CUDA error, then fails the check: the group kills it rather than keep it for the next
    attempt. PASS when the check passed before, and the worker is gone after."""
    label = "a sticky CUDA error leaves the worker unreused"
    if not args.gpus:
        return Part(
            label, "SKIP", "needs a GPU: on the CPU no error is sticky (check_device passes; tests/test_gpu_path.py)"
        )
    import ray
    from ray.exceptions import RayActorError

    from distrain.cluster import warm
    from distrain.cluster.attempt import first_line
    from distrain.cluster.placement import GroupSpec
    from distrain.cluster.worker_group import WorkerGroup

    check = "distrain.parallel.process_group:check_device"
    spec = GroupSpec(num_workers=1, cpus_per_worker=1, gpus_per_worker=1, threads_per_worker=1)
    warm.make_room(spec.bundle(), timeout_s=30)  # the training runs' kept workers hold the GPUs
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # poison_the_device: workers cannot import jobs/
    with WorkerGroup(spec) as group:
        group.start()
        group.recover_with(check, "distrain.parallel.process_group:abort")
        if not ray.get(group.workers[0].call.remote(check), timeout=120):
            return Part(label, "FAIL", "a fresh worker failed the device check")
        group.launch(poison_the_device)
        deadline, raised = time.monotonic() + 120, None
        while raised is None and time.monotonic() < deadline:
            raised = next((error for _, _, error in group.poll(1.0) if error is not None), None)
        if raised is None:
            return Part(label, "FAIL", "the out-of-bounds write raised nothing within 120 s")
        if 0 not in group.returned:  # its process died: nothing is left for the check to judge
            return Part(label, "FAIL", f"the worker's process died of the error ({first_line(raised)})")
        group.release_unhealthy(timeout_s=30)
        if 0 in group.returned:
            return Part(label, "FAIL", f"after {first_line(raised)} the worker passed the check: it would be reused")
        try:
            ray.get(group.workers[0].node_info.remote(), timeout=30)
            return Part(label, "FAIL", "the worker failed the check but is still alive")
        except RayActorError:
            pass
    return Part(
        label,
        "PASS",
        f"the check passed, then the write raised ({first_line(raised)}); the check failed, the worker was killed",
    )


# -- 3 and 4: the benchmarks ----------------------------------------------------------------------


def bench(args: argparse.Namespace, script: str, pages: Path, storage: Path, *extra: str) -> tuple[dict, str]:
    """`python jobs/<script>.py` with its page in `pages` and its numbers in JSON; those numbers ({} if it
    wrote none) and what went wrong, if anything."""
    out = storage / f"{script}.json"
    cmd = [sys.executable, f"jobs/bench/{script}.py", "--out", str(pages / f"{script.removeprefix('bench_')}.md")]
    cmd += ["--json", str(out), "--storage", str(storage / script), *(["--smoke"] if args.smoke else []), *extra]
    try:
        done = processes.run_command(cmd, storage / f"{script}.log", timeout_s=600)  # bench_mfu: 8 runs
    except processes.CommandTimeout as e:
        return {}, str(e).splitlines()[0]
    if done.rc != 0:
        print(done.tail(), file=sys.stderr)
        return {}, f"exited with {done.rc} (log above)"
    return harness.read_json(out, {}), ""


def loss_part(args: argparse.Namespace, pages: Path, storage: Path) -> Part:
    label = "chunked loss (jobs/bench/bench_loss.py)"
    raw, error = bench(args, "bench_loss", pages, storage)
    if error or not raw.get("rows"):
        return Part(label, "FAIL", error or "it wrote no numbers")
    whole, *chunked = raw["rows"]
    best = min(chunked, key=lambda r: r["peak"])
    drift = max(abs(r["loss"] - whole["loss"]) for r in chunked)
    ok = best["peak"] < whole["peak"] and drift <= LOSS_CHUNK_TOLERANCE * max(1.0, abs(whole["loss"]))
    figure = f"{whole['device']}, vocabulary {raw['model']['vocab_size']:,}, {raw['seq']} tokens: peak "
    figure += f"{best['peak'] / 2**20:,.0f} MiB at loss_chunk={best['chunk']}, {whole['peak'] / 2**20:,.0f} MiB whole; "
    figure += f"losses within {drift:.1e}" + (" (smoke)" if args.smoke else "")
    return Part(label, "PASS" if ok else "FAIL", figure)


def mfu_part(args: argparse.Namespace, pages: Path, storage: Path) -> Part:
    label = "MFU (jobs/bench/bench_mfu.py)"
    # The compiled blocks only, in bf16 and (distrain's) in float8: their best is what the goals are about, and
    # eager's three runs would take the part past its budget.
    raw, error = bench(args, "bench_mfu", pages, storage, *([] if args.smoke else ["--variants", "compiled,float8"]))
    if error or not raw:
        return Part(label, "FAIL", error or "it wrote no numbers")
    sides = ", ".join(sorted({r["side"] for r in raw["runs"]}))
    if not args.gpus:
        return Part(label, "PASS", f"ran ({sides}); without a GPU it measures nothing, as it should")
    ran = [r for r in raw["runs"] if r["side"] == "distrain" and r["variant"] != "float8" and r.get("mfu") is not None]
    if not ran:
        return Part(label, "FAIL", f"no MFU: no bf16 peak known for {raw['device']} (--peak-tflops)")
    best = max(ran, key=lambda r: r["mfu"])
    each = ", ".join(f"{r['variant']} {r['mfu']:.1%} ({r['tokens_per_s']:,.0f} tokens/s)" for r in ran)
    against = ", ".join(f"÷ {side} {x:.3f} ({v})" for v, r in raw["ratios"].items() for side, x in r.items())
    held = not args.smoke
    f8 = raw.get("float8_speedup")
    ok = not held or (best["mfu"] >= raw["goal"] and (f8 is None or f8 >= raw["float8_goal"]))
    figure = f"distrain {each}; goal ≥ {raw['goal']:.0%}; distrain {against}"
    figure += f"; float8 {f8:.2f}× compiled bf16 (goal ≥ {raw['float8_goal']:.1f}×)" if f8 is not None else ""
    figure += "" if held else " (smoke)"
    return Part(label, "PASS" if ok else "FAIL", figure)


def collectives_part(args: argparse.Namespace, pages: Path, storage: Path) -> Part:
    label = "collectives (jobs/bench/bench_collectives.py)"
    raw, error = bench(
        args, "bench_collectives", pages, storage, *([] if args.smoke else ["--repeats", str(args.repeats)])
    )
    if error or not raw.get("ratios"):
        return Part(label, "FAIL", error or "no operation ran on both sides")
    ratios = raw["ratios"]
    low = min(ratios, key=ratios.get)
    # gloo on loopback, smoke sizes, or one GPU (nothing crosses a link): the figures are only reported
    held = raw["run"]["backend"] == "nccl" and raw["run"]["world_size"] > 1 and not args.smoke
    ok = not held or ratios[low] >= raw["goal"]
    figure = f"{raw['run']['world_size']} rank(s), {raw['run']['backend']}: distrain ÷ torch.distributed "
    figure += f"{ratios[low]:.3f} at lowest ({low}); goal ≥ {raw['goal']}"
    figure += "" if held else " (not held: it is for NCCL between 2 or more GPUs, at full sizes)"
    return Part(label, "PASS" if ok else "FAIL", figure)


def ring_part(args: argparse.Namespace, pages: Path, storage: Path) -> Part:
    label = "ring attention's blocks (jobs/bench/bench_ring.py)"
    raw, error = bench(args, "bench_ring", pages, storage)
    if error or not raw.get("rows"):
        return Part(label, "FAIL", error or "it wrote no numbers")
    worst = max(max(r["errors"]) for r in raw["rows"])
    each = ", ".join(
        f"{r['seq']} tokens {r['ratio']:.2f}× the time, {r['memory']['ring']:.0f} MiB to {r['memory']['whole']:.0f}"
        for r in raw["rows"]
    )
    figure = f"{raw['cp']} ranks' blocks against sdpa on the whole: {each}; largest error {worst:.1e}"
    if not raw["held"]:
        return Part(label, "PASS", f"{figure} (on the CPU: not held)")
    return Part(label, "PASS" if worst <= raw["tolerance"] else "FAIL", f"{figure} (tolerance {raw['tolerance']:.1e})")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.time()
    page = harness.Page("GPU check: the user's journey, every strategy on NCCL, bf16 against fp32", args)
    device = page.info.get("gpu") or f"CPU ({plural(args.workers, 'worker')} in place of GPUs)"
    print(f"gpu_check: {'GPU' if args.gpus else 'CPU'} mode on {device}; parts: {', '.join(args.parts)}", flush=True)
    with harness.storage(args) as storage:
        pages = storage / "docs" if args.smoke else Path(args.out or harness.DOCS / "gpu.md").parent
        if args.smoke:
            args.out = str(pages / "gpu.md")
        parts, section = [], []
        with harness.ray_cluster():  # one cluster: runs of the same shape keep their workers warm
            if "strategies" in args.parts:
                parts, section = training(args, storage)
            if "journey" in args.parts:
                workers, _ = most_workers(args)
                models, skipped = journey_models(args, storage, workers)
                parts += skipped
                for model in models:
                    parts += journey(args, storage, model, workers)
                section += journey_section(args, workers)
            for name, part in (("ps", ps_part), ("sticky", sticky_part), ("moe", moe_part)):
                if name in args.parts:
                    began = time.time()
                    parts.append(report(part(args) if name == "sticky" else part(args, storage), began))
        optional = (("mfu", mfu_part), ("collectives", collectives_part), ("ring", ring_part))
        for name, part in (("loss", loss_part), *optional):
            if name in args.parts:
                began = time.time()
                parts.append(report(part(args, pages, storage), began))
        rows = [[p.name, f"**{p.status}**", p.figure.replace("|", "/"), f"{p.seconds:.0f}"] for p in parts]
        every = ["## Every part", "", *harness.table(["part", "result", "figure", "seconds"], rows, "lllr"), ""]
        links = "The benchmarks' own pages: [loss.md](loss.md) (the chunked loss's memory), [mfu.md](mfu.md) (MFU), "
        links += "[collectives.md](collectives.md) (bandwidth) and [ring.md](ring.md) (ring attention's blocks)."
        page.write("\n".join([*every, *section, links]))
    failed = [p for p in parts if p.status == "FAIL"]
    counts = {s: sum(p.status == s for p in parts) for s in ("PASS", "FAIL", "SKIP")}
    print(
        f"gpu_check: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped in "
        f"{time.time() - started:.0f} s on {device}",
    )
    if not args.gpus:
        print(
            "gpu_check: CPU mode checked that the scripts work; the GPU figures (NCCL runs, bf16 on CUDA, the journey "
            "on CUDA, the chunked loss's memory, MFU, NCCL bandwidth, ring attention's blocks) are still to be taken: "
            "`make gpu-check "
            "TORCH=torch` on a GPU machine."
        )
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
