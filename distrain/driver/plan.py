"""`--plan`: the layout a run would have (who holds which mesh coordinate, the process groups, the
pipeline stages, an estimate of memory per rank), worked out from the config and, where the workers were
placed, their rank table, so a layout can be checked before anything trains. Neither Ray nor torch here:
the driver places the workers (or does not) and passes the table in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from distrain.cluster.places import RankPlace
from distrain.config import TrainConfig, resolve_precision
from distrain.driver import finetune
from distrain.driver.survival import survivable
from distrain.model.size import linears, num_params, parts
from distrain.strategy import MESH_DIMS, PARALLELISMS, float8
from distrain.strategy.context_parallel import ring_scores
from distrain.strategy.expert_parallel import expert_params, expert_shard_ranks, rank_blocks
from distrain.strategy.layout import Layout
from distrain.strategy.pipeline import in_flight, stage_layers

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
    logits: int = 0  # the loss's, on the ranks of the last stage (`logits_bytes`)

    @property
    def device_total(self) -> int:
        """What the accelerator holds: everything, or with offload only the activations."""
        state = 0 if self.offload != "none" else self.params + self.grads + self.optimizer
        return state + self.activations + self.logits


def human(n: float) -> str:
    units, i = ("B", "KiB", "MiB", "GiB", "TiB"), 0
    while abs(n) >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


def stage_params(cfg: TrainConfig, stage: int, stages: int, layout: Layout) -> int:
    """Parameters one tensor-parallel rank of a pipeline stage holds: its blocks, the input modules on
    stage 0 (the embeddings), the output modules on the last (final norm, head; a head tied to the
    embedding is a copy of its own there when they are different stages). The parallelisms split the
    matrices and the vectors (norms' gains, biases) as their `weight_split` says (tensor parallelism's)."""
    m = cfg.model
    sizes = parts(m, cfg.trainer.seq_len)
    n = len(stage_layers(m.n_layers, stages)[stage])
    matrices, vectors = n * sizes.block[0], n * sizes.block[1]
    if stage == 0:
        matrices, vectors = matrices + sizes.input[0], vectors + sizes.input[1]
    if stage == stages - 1:
        matrices, vectors = matrices + sizes.output[0], vectors + sizes.output[1]
        matrices += sizes.tied if stages > 1 else 0
    splits = [p.weight_split(layout) for p in PARALLELISMS]
    matrix_blocks, norm_blocks = math.prod(a for a, _ in splits), math.prod(b for _, b in splits)
    return matrices // matrix_blocks + vectors // norm_blocks


def optimizer_states(cfg: TrainConfig) -> int:
    """fp32 tensors the optimizer keeps per parameter: AdamW's two moments, SGD's momentum buffer if any."""
    o = cfg.optim
    return 2 if o.name == "adamw" else int(o.momentum != 0)


def layer_activations(cfg: TrainConfig, layout: Layout, precision: str, scores: bool = True) -> tuple[int, int]:
    """(bytes a block keeps for the backward pass, bytes it needs while its forward is recomputed).

    Korthikanti et al. 2022, eq. 1-2 and 4: a transformer block stores s·b·h·(34 + 5·a·s/h) bytes in
    16-bit (s sequence, b micro-batch, h dim, a heads); the parallelisms divide it all as their
    `activation_split` says (tensor parallelism, always with sequence parallelism here, by tp); fp32
    doubles it; with activation checkpointing a block keeps only its 2·s·b·h input (divided alike).
    An estimate: it assumes a 4h MLP, and counts the a·s² attention scores that a fused SDPA kernel does not store
    (`scores=False` leaves them out). Ring context parallelism never holds them: it keeps q, k, v, the output
    and its log-sum-exp (in the 34·s·b·h), and its blocks score a tile of query rows at a time (the fused
    kernel's own, or its math fallback's), whose fp32 working set at most is added to what a block needs while it
    runs (`ring_scores`), whatever `scores` says.
    """
    m, t = cfg.model, cfg.trainer
    sbh = t.seq_len * t.micro_batch_size * m.dim
    ring = ring_scores(cfg, layout)
    attention = 5 * m.n_heads * t.seq_len**2 * t.micro_batch_size if scores and ring is None else 0
    split = math.prod(p.activation_split(layout) for p in PARALLELISMS)
    full, kept = (34 * sbh + attention) // split, 2 * sbh // split
    scale = 2 if precision == "fp32" else 1
    return scale * (kept if cfg.strategy.activation_checkpoint else full), scale * full + (ring or 0)


LOGIT_BYTES = 12  # fp32 logits, their log-softmax and its gradient at once: docs/loss.md measured 3.06× the logits
HELD_LOGIT_BYTES = 8  # what a micro-batch's forward keeps of them until its backward


def logits_bytes(cfg: TrainConfig, layout: Layout, pp_rank: int) -> int:
    """The loss's peak over the logits, on the ranks holding the last stage: LOGIT_BYTES an element of micro-batch ×
    its positions on the rank (seq_len / cp) × the vocabulary (1/tp of it under vocabulary-parallel 1-D TP), the
    loss upcasting to fp32 under any precision; a pipeline's micro-batches in flight each keep HELD_LOGIT_BYTES until
    their backward. trainer.loss_chunk: one slice's alone (its logits recomputed in the backward, none kept)."""
    if layout.num_stages - 1 not in layout.stages(pp_rank):
        return 0
    t, vocab = cfg.trainer, cfg.model.vocab_size
    if layout.tp > 1 and layout.tp_mode == "1d" and cfg.strategy.loss_parallel:
        vocab = -(-vocab // layout.tp)
    positions = t.seq_len // layout.cp
    if t.loss_chunk:
        return LOGIT_BYTES * t.micro_batch_size * min(positions, max(1, t.loss_chunk // t.micro_batch_size)) * vocab
    held = HELD_LOGIT_BYTES * (in_flight(layout, pp_rank) - 1) + LOGIT_BYTES
    return held * t.micro_batch_size * positions * vocab


def rank_memory(cfg: TrainConfig, layout: Layout, pp_rank: int, precision: str, scores: bool = True) -> Memory:
    """Per-rank memory for the ranks at `pp_rank` (the other coordinates hold equal shares). With
    P the rank's parameters and N = dp_shard × cp: ZeRO-0 keeps P params, P grads, K·P optimizer state;
    ZeRO-1 shards the optimizer state (K·P/N); ZeRO-2 the gradients too (P/N); ZeRO-3 the parameters
    too (P/N). Offload keeps the ZeRO-3 numbers in CPU memory. 1-D tensor parallelism leaves the routers and
    the routed experts whole (distrain/model/moe.py, moe_tp_plan). Expert parallelism's experts are 1/ep on each
    rank (those of its stages' blocks), sharded by ZeRO-2/3 over ep_rest's ranks within a replica, as
    parallel/data_parallel.py's shard_experts does; ZeRO-1 leaves them whole. A LoRA run (finetune.lora) holds
    gradients and optimizer state of its adapters alone, spread over the ranks as the base's parameters are."""
    s = cfg.strategy
    stages, n_stages = layout.stages(pp_rank), layout.num_stages
    p = sum(stage_params(cfg, i, n_stages, layout) for i in stages)
    blocks = rank_blocks(cfg, layout, pp_rank)
    whole = expert_params(cfg, blocks, routers=True)  # stage_params split them as it splits every matrix
    p += whole - whole // math.prod(par.weight_split(layout)[0] for par in PARALLELISMS)
    ep = layout.settings.get("ep", 1)
    experts = expert_params(cfg, blocks) if ep > 1 else 0
    p, mine = p - experts, experts // ep
    within = expert_shard_ranks(layout) if ep > 1 else 1  # ZeRO-2/3 shards a rank's experts over ep_rest's

    def shard(n: int, level: int) -> int:  # over dp_shard (× cp, folded in) from ZeRO `level` up (rounded up: padding)
        return -(-n // (layout.dp_shard * layout.cp)) if s.zero >= level else n

    def experts_at(n: int, level: int) -> int:  # n of a rank's experts' from ZeRO `level` up (ZeRO-1 keeps them whole)
        return -(-n // within) if s.zero >= max(level, 2) else n

    layers = sum(len(stage_layers(cfg.model.n_layers, n_stages)[i]) for i in stages)
    kept, full = layer_activations(cfg, layout, precision, scores)
    activations = layers * in_flight(layout, pp_rank) * kept + (full - kept)
    trained, mine_trained, k = p, mine, optimizer_states(cfg)
    added = finetune.adapter_params(cfg)  # a LoRA run: only its adapters have gradients and optimizer state
    if added:  # the adapters spread as their base's parameters; the experts', counted apart, as the experts
        on_experts = finetune.expert_adapter_params(cfg) if ep > 1 else 0
        apart = expert_params(cfg) if ep > 1 else 0
        trained = -(-p * (added - on_experts) // (num_params(cfg.model, cfg.trainer.seq_len) - apart))
        mine_trained = -(-mine * on_experts // apart) if apart else 0
        p, mine = p + trained, mine + mine_trained
    return Memory(
        params=FP32 * (shard(p, 3) + experts_at(mine, 3)),
        grads=FP32 * (shard(trained, 2) + experts_at(mine_trained, 2)),
        optimizer=FP32 * (shard(k * trained, 1) + k * experts_at(mine_trained, 1)),
        activations=activations,
        offload=s.offload,
        logits=logits_bytes(cfg, layout, pp_rank),
    )


def _group(ranks: list[int]) -> str:
    return "[" + ",".join(map(str, ranks)) + "]"


def mesh_lines(layout: Layout, table: list[RankPlace] | None) -> list[str]:
    """One row per rank: the worker (index in the placement group, pid), its node, its GPU, its coordinate;
    without a table (not placed), its coordinate only."""
    if table is None:
        rows: list[tuple] = [("rank", *MESH_DIMS)]
        rows += [(r, *layout.coordinate(r).values()) for r in range(layout.world_size)]
    else:
        rows = [("rank", "worker", "pid", "node (ip #rank)", "device", *MESH_DIMS)]
    for e in table or []:
        device = "GPU " + ",".join(map(str, e.gpu_ids)) if e.gpu_ids else "cpu"
        coord = layout.coordinate(e.rank)
        rows.append((e.rank, e.worker_index, e.pid, f"{e.node_ip} #{e.node_rank}", device, *coord.values()))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def group_lines(layout: Layout) -> list[str]:
    """The ranks of each process group, for every mesh dim of size > 1."""
    lines = [
        f"  {d}: " + " ".join(_group(g) for g in layout.groups(d)) for d, n in layout.mesh_sizes().items() if n > 1
    ]
    return lines or ["  none: a single rank"]


def worker_memory(cfg: TrainConfig, layout: Layout, precision: str, scores: bool = True) -> list[Memory]:
    """What a worker holds, for each pipeline rank: `rank_memory`, less the optimizer state where parameter
    servers hold it."""
    mems = [rank_memory(cfg, layout, pp_rank, precision, scores) for pp_rank in range(layout.pp)]
    if cfg.ps.mode not in (None, "easgd"):
        mems = [replace(mem, optimizer=0) for mem in mems]  # the parameter servers hold it
    return mems


def memory_lines(cfg: TrainConfig, layout: Layout, precision: str) -> list[str]:
    o, s = cfg.optim, cfg.strategy
    ring = " (under ring cp none: a tile of query rows at a time)" if ring_scores(cfg, layout) is not None else ""
    lines = [
        f"memory per rank (estimate: fp32 parameters, gradients and {o.name} state ({optimizer_states(cfg)} per "
        f"parameter); {precision} activations of the blocks, Korthikanti et al. 2022, attention scores counted{ring}):"
    ]
    for pp_rank, mem in enumerate(worker_memory(cfg, layout, precision)):
        ranks = [r for r in range(layout.world_size) if layout.coordinate(r)["pp"] == pp_rank]
        n = in_flight(layout, pp_rank)
        who = "every rank" if layout.pp == 1 else f"pp rank {pp_rank} {_group(ranks)}"
        lines.append(
            f"  {who}: params {human(mem.params)}, grads {human(mem.grads)}, optimizer {human(mem.optimizer)}, "
            f"activations {human(mem.activations)} ({n} micro-batch{'es' * (n > 1)} in flight); "
            + (f"the loss's logits {human(mem.logits)}; " if mem.logits else "")
            + f"total {human(mem.device_total)}{' on the device' if mem.offload != 'none' else ''}"
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


def describe(
    cfg: TrainConfig,
    layout: Layout,
    table: list[RankPlace] | None,
    gpu: bool | None = None,
    unplaced: str = "",
    checked: str = "",
) -> str:
    """The plan as text, for a config, its layout and the placed workers' rank table; with `table` None, not
    placed (`unplaced`: where the ranks would run; `gpu`: whether they get GPUs, else whether the table's have).
    `checked`: what the memory check would do with the run."""
    s = cfg.strategy
    gpu = any(e.gpu_ids for e in table or []) if gpu is None else gpu
    precision = resolve_precision(cfg.trainer.precision, gpu)
    nodes = len({e.node_id for e in table or []})
    placed = "not placed" if table is None else f"on {nodes} node{'s' * (nodes > 1)}"
    where = f"{layout.world_size} ranks {placed}, {'GPU' if gpu else 'CPU'}, {precision}"
    shape = " × ".join(f"{d}={v}" for d, v in layout.mesh_sizes().items())
    offload = f", offload {s.offload}" if s.offload != "none" else ""
    not_placed = (
        f"  not placed: {unplaced}; which node and GPU holds each rank needs the cluster: give cluster.address "
        "(or RAY_ADDRESS) to place the workers as the run would"
    )
    lines = [
        f"distrain plan: {where}; strategy {s.name} (zero {s.zero}{offload}); mesh {shape}; "
        f"model {num_params(cfg.model, cfg.trainer.seq_len):,} parameters",
        "mesh:",
        *mesh_lines(layout, table),
        *([not_placed] if table is None else []),
        *(["process groups:", *group_lines(layout)] if cfg.ps.mode is None else server_lines(cfg)),
        *(line for p in reversed(PARALLELISMS) for line in p.plan_lines(cfg, layout)),
        *(
            float8.plan_lines(cfg, layout, *linears(cfg.model, cfg.trainer.seq_len), gpu)
            if cfg.trainer.float8 != "none"
            else []
        ),
        *finetune.plan_lines(cfg, num_params(cfg.model, cfg.trainer.seq_len)),
        *memory_lines(cfg, layout, precision),
        *([checked] if checked else []),
        *(survivable(layout, table or [], cfg.cluster.peer_recovery) if cfg.ps.mode is None else []),
    ]
    return "\n".join(lines)
