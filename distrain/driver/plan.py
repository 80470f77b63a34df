"""`--plan`: the layout a run would have (who holds which mesh coordinate, the process groups, the
pipeline stages, an estimate of memory per rank), worked out from the config and the placed workers'
rank table, so a layout can be checked before anything trains. Neither Ray nor torch here: the driver
places the workers and passes the table in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from distrain.config import TrainConfig, resolve_precision
from distrain.layout import MESH_DIMS, SCHEDULES, Layout, stage_layers, tp_grid
from distrain.model.size import num_params, parts
from distrain.tpcost import weight_split

FP32 = 4  # bytes: master weights, gradients and optimizer state are fp32 whatever the precision


@dataclass(frozen=True)
class Memory:
    """Bytes one rank holds; with `offload` (cpu, nvme) the model state lives in CPU memory instead of the
    GPU's, and under nvme the optimizer state on disk."""

    params: int
    grads: int
    optimizer: int
    activations: int
    offload: str = "none"

    @property
    def device_total(self) -> int:
        """What the accelerator holds: everything, or with offload only the activations."""
        state = 0 if self.offload != "none" else self.params + self.grads + self.optimizer
        return state + self.activations


def human(n: float) -> str:
    units, i = ("B", "KiB", "MiB", "GiB", "TiB"), 0
    while abs(n) >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


def stage_params(cfg: TrainConfig, stage: int, stages: int, layout: Layout) -> int:
    """Parameters one tensor-parallel rank of a pipeline stage holds: its blocks, the input modules on
    stage 0 (the embeddings), the output modules on the last (final norm, head; a head tied to the
    embedding is a copy of its own there when they are different stages). Tensor parallelism splits
    the matrices and the vectors (norms' gains, biases) as tpcost.weight_split says."""
    m = cfg.model
    sizes = parts(m, cfg.trainer.seq_len)
    n = len(stage_layers(m.n_layers, stages)[stage])
    matrices, vectors = n * sizes.block[0], n * sizes.block[1]
    if stage == 0:
        matrices, vectors = matrices + sizes.input[0], vectors + sizes.input[1]
    if stage == stages - 1:
        matrices, vectors = matrices + sizes.output[0], vectors + sizes.output[1]
        matrices += sizes.tied if stages > 1 else 0
    matrix_blocks, norm_blocks = weight_split(layout.tp_mode, layout.tp, layout.tp_depth)
    return matrices // matrix_blocks + vectors // norm_blocks


def optimizer_states(cfg: TrainConfig) -> int:
    """fp32 tensors the optimizer keeps per parameter: AdamW's two moments, SGD's momentum buffer if any."""
    o = cfg.optim
    return 2 if o.name == "adamw" else int(o.momentum != 0)


def in_flight(layout: Layout, pp_rank: int) -> int:
    """Micro-batches whose activations a rank holds at once: one without a pipeline (gradient
    accumulation runs them one after another); all of them for GPipe-like schedules; for the 1F1B
    family the pp − pp_rank of the warm-up (Narayanan et al. 2021), taken as is for the interleaved ones."""
    if layout.pp == 1:
        return 1
    n = layout.micro_batches
    return n if SCHEDULES[layout.schedule].all_at_once else min(n, layout.pp - pp_rank)


def layer_activations(cfg: TrainConfig, layout: Layout, precision: str) -> tuple[int, int]:
    """(bytes a block keeps for the backward pass, bytes it needs while its forward is recomputed).

    Korthikanti et al. 2022, eq. 1-2 and 4: a transformer block stores s·b·h·(34 + 5·a·s/h) bytes in
    16-bit (s sequence, b micro-batch, h dim, a heads); tensor parallelism (always with sequence
    parallelism here) divides it all by tp; fp32 doubles it; with activation checkpointing a block
    keeps only its 2·s·b·h input (÷ tp). An estimate: it
    assumes a 4h MLP, and counts the a·s² attention scores that a fused SDPA kernel does not store.
    """
    m, t = cfg.model, cfg.trainer
    sbh, scores, tp = (
        t.seq_len * t.micro_batch_size * m.dim,
        5 * m.n_heads * t.seq_len**2 * t.micro_batch_size,
        layout.tp,
    )
    full, kept = (34 * sbh + scores) // tp, 2 * sbh // tp
    scale = 2 if precision == "fp32" else 1
    return scale * (kept if cfg.strategy.activation_checkpoint else full), scale * full


def rank_memory(cfg: TrainConfig, layout: Layout, pp_rank: int, precision: str) -> Memory:
    """Per-rank memory for the ranks at `pp_rank` (the other coordinates hold equal shares). With
    P the rank's parameters and N = dp_shard: ZeRO-0 keeps P params, P grads, K·P optimizer state;
    ZeRO-1 shards the optimizer state (K·P/N); ZeRO-2 the gradients too (P/N); ZeRO-3 the parameters
    too (P/N). Offload keeps the ZeRO-3 numbers in CPU memory."""
    s = cfg.strategy
    stages, n_stages = layout.stages(pp_rank), layout.num_stages
    p = sum(stage_params(cfg, i, n_stages, layout) for i in stages)

    def shard(n: int, level: int) -> int:  # sharded over dp_shard from ZeRO `level` up (rounded up: padding)
        return -(-n // layout.dp_shard) if s.zero >= level else n

    layers = sum(len(layout.stage_layers(cfg.model.n_layers)[i]) for i in stages)
    kept, full = layer_activations(cfg, layout, precision)
    activations = layers * in_flight(layout, pp_rank) * kept + (full - kept)
    return Memory(
        params=FP32 * shard(p, 3),
        grads=FP32 * shard(p, 2),
        optimizer=FP32 * shard(optimizer_states(cfg) * p, 1),
        activations=activations,
        offload=s.offload,
    )


def _group(ranks: list[int]) -> str:
    return "[" + ",".join(map(str, ranks)) + "]"


def _layers(r: range) -> str:
    return f"layer {r.start}" if len(r) == 1 else f"layers {r.start}-{r.stop - 1}"


def mesh_lines(layout: Layout, table: list[dict]) -> list[str]:
    """One row per rank: the worker (index in the placement group, pid), its node, its GPU, its coordinate."""
    rows = [("rank", "worker", "pid", "node (ip #rank)", "device", *MESH_DIMS)]
    for e in table:
        device = "GPU " + ",".join(map(str, e["gpu_ids"])) if e["gpu_ids"] else "cpu"
        coord = layout.coordinate(e["rank"])
        rows.append(
            (e["rank"], e["worker_index"], e["pid"], f"{e['node_ip']} #{e['node_rank']}", device, *coord.values())
        )
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def group_lines(layout: Layout) -> list[str]:
    """The ranks of each process group, for every mesh dim of size > 1."""
    lines = [
        f"  {d}: " + " ".join(_group(g) for g in layout.groups(d)) for d, n in layout.mesh_sizes().items() if n > 1
    ]
    return lines or ["  none: a single rank"]


def _chunk(index: int, chunks: int, n: int) -> str:
    return f"{index * n // chunks}-{(index + 1) * n // chunks - 1}"


def grid_lines(cfg: TrainConfig, layout: Layout) -> list[str]:
    """Which block of the activations and weights each rank of one tensor-parallel group holds (every
    group holds the same blocks): the residual stream's sequences of a micro-batch and hidden features,
    and a dim×dim projection's block (distrain/parallel/tpnd/grid.py)."""
    b, h = cfg.trainer.micro_batch_size, cfg.model.dim
    grid = dict(tp_grid(layout.tp_mode, layout.tp, layout.tp_depth))
    how = {"2d": "SUMMA", "2.5d": "SUMMA on each depth's grid", "3d": "3-D matmul"}[layout.tp_mode]
    lines = [f"tensor-parallel grid ({layout.tp_mode}: {' × '.join(f'{d}={n}' for d, n in grid.items())}, {how}); "
             f"a micro-batch of {b} sequences, hidden {h}; projection W[out, in] as nn.Linear holds it:"]  # fmt: skip
    for rank in range(layout.tp):
        c = layout.tp_coordinate(rank)
        where = ", ".join(f"{d} {v}" for d, v in c.items())
        if layout.tp_mode == "3d":
            q = grid["tp_k"]
            rows, hidden = _chunk(c["tp_i"] * q + c["tp_j"], q * q, b), _chunk(c["tp_k"], q, h)
            reading = f"W[out {_chunk(c['tp_j'] * q + c['tp_i'], q * q, h)}, in {hidden}]"
            writing = f"W[out {_chunk(c['tp_k'] * q + c['tp_i'], q * q, h)}, in {_chunk(c['tp_j'], q, h)}]"
            block = f"projections reading the stream {reading}, writing to it {writing}"
        else:
            q, depth = grid["tp_col"], grid.get("tp_depth", 1)
            rows, hidden = _chunk(c.get("tp_depth", 0) * q + c["tp_row"], depth * q, b), _chunk(c["tp_col"], q, h)
            block = f"W[out {hidden}, in {_chunk(c['tp_row'], q, h)}]" + (" (copied over depth)" if depth > 1 else "")
        lines.append(f"  rank {rank} ({where}): sequences {rows}, hidden {hidden}; {block}")
    return lines


def pipeline_lines(cfg: TrainConfig, layout: Layout) -> list[str]:
    stages = layout.num_stages
    lines = [f"pipeline ({layout.schedule}, {stages} stages, {layout.micro_batches} micro-batches per step):"]
    for pp_rank in range(layout.pp):
        for i in layout.stages(pp_rank):
            parts = ["embedding"] if i == 0 else []
            parts.append(_layers(stage_layers(cfg.model.n_layers, stages)[i]))
            parts += ["norm", "output"] if i == stages - 1 else []
            lines.append(f"  stage {i} on pp rank {pp_rank}: {', '.join(parts)}")
    return lines


def memory_lines(cfg: TrainConfig, layout: Layout, precision: str) -> list[str]:
    o, s = cfg.optim, cfg.strategy
    lines = [
        f"memory per rank (estimate: fp32 parameters, gradients and {o.name} state ({optimizer_states(cfg)} per "
        f"parameter); {precision} activations of the blocks, Korthikanti et al. 2022):"
    ]
    for pp_rank in range(layout.pp):
        ranks = [r for r in range(layout.world_size) if layout.coordinate(r)["pp"] == pp_rank]
        mem, n = rank_memory(cfg, layout, pp_rank, precision), in_flight(layout, pp_rank)
        if cfg.ps.mode not in (None, "easgd"):
            mem = replace(mem, optimizer=0)  # the parameter servers hold it
        who = "every rank" if layout.pp == 1 else f"pp rank {pp_rank} {_group(ranks)}"
        lines.append(
            f"  {who}: params {human(mem.params)}, grads {human(mem.grads)}, optimizer {human(mem.optimizer)}, "
            f"activations {human(mem.activations)} ({n} micro-batch{'es' * (n > 1)} in flight); "
            f"total {human(mem.device_total)}{' on the device' if mem.offload != 'none' else ''}"
        )
        if mem.offload == "cpu":
            lines.append(
                "    offload: parameters, gradients and optimizer state sit in CPU memory; the GPU holds the "
                "activations and the one gathered block being computed"
            )
        if mem.offload == "nvme":
            lines.append(
                f"    nvme offload: parameters and gradients sit in CPU memory, the optimizer state in files under "
                f"{s.nvme_directory(cfg.run.name)}, streamed through {s.nvme_buffer_mb:g} MiB of host buffers; "
                f"the GPU holds the activations and the one gathered block being computed"
            )
    return lines


def server_lines(cfg: TrainConfig) -> list[str]:
    s, w = cfg.ps, cfg.cluster.num_workers
    per_server = -(-num_params(cfg.model, cfg.trainer.seq_len) // s.num_servers) * FP32
    how = {
        "sync": f"each step applies the mean of the first {w - s.backup_workers} of {w} gradients",
        "async": "each gradient applied as it arrives"
        + (f", at most {s.max_staleness} versions stale" if s.max_staleness is not None else ""),
        "hogwild": "each gradient applied as it arrives, concurrently and without a lock",
        "easgd": f"workers train their own weights, elastic exchange every {s.tau} steps "
        f"(alpha {s.elastic_alpha(w):g})",
    }[s.mode]
    return [
        f"parameter servers: {s.num_servers}, mode {s.mode}: {how}; no process group (weights go out through the "
        "object store, gradients come in by Ray calls)",
        f"  each server: params {human(per_server)}, optimizer {human(per_server * optimizer_states(cfg))}",
    ]


def describe(cfg: TrainConfig, layout: Layout, table: list[dict]) -> str:
    """The plan as text, for a config, its layout and the placed workers' rank table."""
    s = cfg.strategy
    gpu = any(e["gpu_ids"] for e in table)
    precision = resolve_precision(cfg.trainer.precision, gpu)
    nodes = len({e["node_id"] for e in table})
    where = f"{len(table)} ranks on {nodes} node{'s' * (nodes > 1)}, {'GPU' if gpu else 'CPU'}, {precision}"
    shape = " × ".join(f"{d}={v}" for d, v in layout.mesh_sizes().items())
    offload = f", offload {s.offload}" if s.offload != "none" else ""
    lines = [
        f"distrain plan: {where}; strategy {s.name} (zero {s.zero}{offload}); mesh {shape}; "
        f"model {num_params(cfg.model, cfg.trainer.seq_len):,} parameters",
        "mesh:",
        *mesh_lines(layout, table),
        *(["process groups:", *group_lines(layout)] if cfg.ps.mode is None else server_lines(cfg)),
        *(grid_lines(cfg, layout) if layout.tp > 1 and layout.tp_mode != "1d" else []),
        *(pipeline_lines(cfg, layout) if layout.pp > 1 else []),
        *memory_lines(cfg, layout, precision),
    ]
    return "\n".join(lines)
