"""Float8 training (trainer.float8) as the driver and the ranks both see it, torch-free: the recipes, which of a
model's nn.Linear modules are converted (the rule torchtitan's converter follows), where the float8 matmul can run,
the config's rules and the `--plan` section. The conversion itself is distrain/parallel/float8.py (torchao's).

torchao's Float8Linear casts a converted module's input, weight and output gradient to float8 (e4m3 forward,
e5m2 for the gradient under tensorwise scaling, e4m3 throughout under rowwise), each with a scale computed from
its absolute maximum at every step (dynamic scaling), and multiplies them with torch._scaled_mm; the weights, their
gradients and the optimizer stay in high precision. On a CPU the float8 matmul is emulated (the same casts, the
product in high precision): the numbers of a GPU run, not its speed.
"""

from __future__ import annotations

import importlib.util

from distrain.config import TrainConfig
from distrain.strategy.layout import Layout
from distrain.strategy.parallelism import require

# trainer.float8: "none", or the scaling recipe. tensorwise: one scale per tensor, so FSDP2 can all-gather the
# weights already cast (enable_fsdp_float8_all_gather); rowwise: one scale per row, more accurate, gathered in
# high precision.
RECIPES = ("tensorwise", "rowwise")
FLOAT8_EXTRA = "pip install 'distrain[float8]'"  # torchao
FP8_CAPABILITY = (8, 9)  # Ada (SM 89), Hopper (SM 90) and later have float8 tensor cores; torch._scaled_mm needs them
ALIGNMENT = 16  # float8 matmuls need both of a weight's dims divisible by 16
ROUTER = "router"  # a mixture-of-experts router: its scores decide where tokens go, kept in high precision


class Float8Unsupported(RuntimeError):
    permanent = True  # read by the supervisor: the same GPU on every attempt, so the run ends at once


def check_gpu(capability: tuple[int, int], name: str) -> None:
    """Refuse, in one line, a GPU of this compute capability (torch.cuda.get_device_capability) without float8
    tensor cores; a test feeds an older GPU's."""
    if tuple(capability) < FP8_CAPABILITY:
        major, minor = capability
        raise Float8Unsupported(
            f"trainer.float8 needs float8 tensor cores (compute capability ≥ 8.9: Ada, Hopper or later); {name} has "
            f"{major}.{minor}: set trainer.float8=none on this GPU"
        )


def gathers_float8(recipe: str, zero: int, layout: Layout) -> bool:
    """Whether FSDP2 all-gathers the converted weights in float8: under tensorwise scaling, where ZeRO-2/3 shards
    over more than one rank and no tensor parallelism splits them too (measured on 4 CPU ranks: with it fsdp_tp
    drifted 1e-3 from one process in 3 steps, where ZeRO-3 and TP alone held 1e-6; torchao's scale, taken over the
    FSDP2 shards, is then not the whole weight's); elsewhere they are gathered in high precision and cast after."""
    return recipe == "tensorwise" and zero >= 2 and layout.gradient_width > 1 and layout.tp == 1


def kept(fqn: str, in_features: int, out_features: int, output_modules: tuple[str, ...]) -> str | None:
    """Why the nn.Linear `fqn` stays in high precision, or None: it is converted. The head (a top-level output
    module) and a router stay, as torchtitan leaves `output` and `router.gate`; so does a module with a dim not
    divisible by 16, which float8 matmuls cannot take."""
    if fqn.split(".")[0] in output_modules:
        return "the head"
    if fqn.split(".")[-1] == ROUTER:
        return "a router"
    if in_features % ALIGNMENT or out_features % ALIGNMENT:
        return f"{in_features}×{out_features}: a dim not divisible by {ALIGNMENT}"
    return None


def validate(cfg: TrainConfig) -> None:
    """trainer.float8's rules, each a one-line ConfigError naming the key and the fix."""
    f8, s = cfg.trainer.float8, cfg.strategy
    require(f8 in ("none", *RECIPES), f"trainer.float8={f8!r}: choose none, {', '.join(RECIPES)}")
    if f8 == "none":
        return
    require(
        importlib.util.find_spec("torchao") is not None,
        f"trainer.float8={f8} needs torchao, which is not installed: {FLOAT8_EXTRA}",
    )
    require(
        s.tp == 1 or s.tp_mode == "1d",
        f"trainer.float8={f8} strategy.tp_mode={s.tp_mode}: the grid layers compute their own matmuls, which "
        "float8 does not convert; use strategy.tp_mode=1d or trainer.float8=none",
    )


def plan_lines(
    cfg: TrainConfig, layout: Layout, linears: dict[str, tuple[int, int]], output_modules: tuple[str, ...], gpu: bool
) -> list[str]:
    """--plan's float8 section: the recipe, where the matmul runs, every nn.Linear converted (a block's named once
    for all the blocks that have it) and every one kept in high precision, with the reason."""
    f8 = cfg.trainer.float8
    if f8 == "none":
        return []
    groups: dict[tuple[str, str | None], list[str]] = {}  # (name in its block, why kept) → blocks
    for fqn, (fan_in, fan_out) in linears.items():
        parts = fqn.split(".")
        block, name = (parts[1], ".".join(parts[2:])) if parts[0] == "layers" else ("", fqn)
        groups.setdefault((name, kept(fqn, fan_in, fan_out, output_modules)), []).append(block)
    where = "float8 tensor cores (torch._scaled_mm)" if gpu else "emulated on the CPU: a GPU run's numbers"
    gather = (
        ", FSDP2 all-gathers the converted weights in float8" if gathers_float8(f8, cfg.strategy.zero, layout) else ""
    )
    count = sum(len(blocks) for (_, reason), blocks in groups.items() if reason is None)
    lines = [f"float8 ({f8} scaling, {where}{gather}): {count} of {len(linears)} nn.Linear converted (torchao)"]
    for (name, reason), blocks in sorted(groups.items(), key=lambda g: g[0][1] is not None):
        at = f" in block{'s' * (len(blocks) > 1)} {_spans(blocks)}" if blocks != [""] else ""
        lines.append(f"  {name}{at}" if reason is None else f"  kept in high precision: {name}{at} ({reason})")
    return lines


def _spans(blocks: list[str]) -> str:
    """Block numbers as runs: 0-3, 5."""
    numbers, runs = sorted(int(b) for b in blocks), []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
