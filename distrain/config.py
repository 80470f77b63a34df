"""The typed configuration: one dataclass per Hydra group, the only place a default is said.

Hydra composes `conf/` on top of these schemas (so a misspelt key fails at composition); the
files in `conf/` hold presets, i.e. only what differs from these defaults. `validation.validate`
checks what types cannot. The dataclasses themselves cross into the actors (`train.job.RankJob`,
`ps.job.ServerJob` and `WorkerJob`); `to_plain` makes the plain dict a checkpoint records and a resume
compares (`from_plain` rebuilds the dataclasses from a recorded one). Nothing here touches
Hydra's global state: `distrain.driver.cli` registers the schema and composes.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, OmegaConf

from distrain.redaction import redact
from distrain.urls import is_url, mirror_dir, run_location


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the key and the fix."""


@dataclass
class MoEConfig:
    """Mixture-of-experts blocks (the moe family, distrain/model/moe.py; model=moe_nano): a chosen block's MLP
    becomes `num_experts` SwiGLU experts and a router sending each token to `top_k` of them. Which blocks: from
    block `first_dense` on, every `every`-th. docs/moe.md."""

    num_experts: int = 0  # 0: no block has experts
    top_k: int = 2
    expert_dim: int | None = None  # each expert's hidden width; None: model.ffn_dim
    shared_experts: int = 0  # experts every token passes through besides its top_k (DeepSeek), expert_dim wide each
    every: int = 1  # blocks i >= first_dense with (i + 1) % every == 0 have experts (Qwen's decoder_sparse_step)
    first_dense: int = 0  # the first blocks keep a dense MLP (DeepSeek-V3: 3)
    score: str = "softmax"  # softmax | sigmoid: the experts' scores from the router's logits
    normalize: bool = True  # the top_k scores divided by their sum (Mixtral; Qwen3's norm_topk_prob)
    # aux_loss: Switch/Mixtral's load-balancing loss; bias: DeepSeek-V3's loss-free balancing, a per-expert bias
    # on the choice (not on the weights) moved by bias_rate each step towards the mean load; none
    balance: str = "aux_loss"
    aux_loss_weight: float = 0.01
    bias_rate: float = 0.001
    z_loss_weight: float = 0.0  # the router's z-loss (ST-MoE): mean logsumexp(logits)²; 0: off
    capacity_factor: float = 0.0  # 0: dropless; else an expert takes at most cf·tokens·top_k/num_experts tokens

    def is_sparse(self, block: int) -> bool:
        """Whether block `block` has experts."""
        return self.num_experts > 0 and block >= self.first_dense and (block + 1) % self.every == 0


@dataclass
class ModelConfig:
    """The shape comes from a preset in conf/model/ (model=nano, gpt2_124m, llama_1b, ...)."""

    # What builds the model: a class or function (cfg: ModelConfig, max_seq_len: int, seed: int) -> nn.Module
    # keeping the contract of distrain/model/contract.py. Shipped families: distrain.model.llama.Transformer,
    # distrain.model.gpt2.GPT2; a user's own: `model._target_=pkg.module.fn`.
    _target_: str = "distrain.model.llama.Transformer"
    name: str = MISSING
    dim: int = MISSING
    n_layers: int = MISSING
    n_heads: int = MISSING
    ffn_dim: int = MISSING
    n_kv_heads: int | None = None  # None: as many as n_heads (no grouped-query attention)
    head_dim: int | None = None  # each attention head's width; None: dim / n_heads (Qwen3 sets its own)
    qk_norm: bool = False  # each head's Q and K RMS-normed over head_dim before the rotation (Qwen3)
    vocab_size: int = 256  # byte-level tokens
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    tie_embeddings: bool = False  # the head's weight is the token embedding's (GPT-2; some Llamas)
    n_positions: int | None = None  # learned positions' table (GPT-2); None: trainer.seq_len
    # A Hugging Face model directory (config.json + safetensors): the model's shape and first weights come from it.
    init_from: str | None = None
    moe: MoEConfig = field(default_factory=MoEConfig)  # the moe family's experts (model=moe_nano)

    def head_width(self) -> int:
        """Each attention head's width: model.head_dim, else dim / n_heads."""
        return self.dim // self.n_heads if self.head_dim is None else self.head_dim


@dataclass
class StrategyConfig:
    """Where the workers sit on the mesh and how each parallelism is applied to the model. The
    defaults are DDP; `name` labels the preset (conf/strategy/), and these fields decide the
    layout, so any preset can be bent with overrides, e.g. `strategy=zero3 strategy.dp_replicate=2`
    is HSDP."""

    name: str = "ddp"
    # Parallel dimensions; their product is the world size. -1 (on one of the two data-parallel
    # dims) means "all the workers the other dimensions leave".
    dp_replicate: int = -1
    dp_shard: int = 1
    tp: int = 1  # tensor-parallel ranks in all, laid out as tp_mode says
    pp: int = 1
    cp: int = 1  # context-parallel ranks: each holds 1/cp of every sequence (distrain/parallel/context_parallel.py)
    # expert-parallel ranks, borrowed from the gradient group (dp_replicate × dp_shard × cp): each holds
    # num_experts / ep of every mixture-of-experts layer's experts (distrain/parallel/expert_parallel.py)
    ep: int = 1
    cp_mode: str = "ring"  # ring: K/V passed round the cp group; alltoall: heads <-> sequence (Ulysses)
    # 1d: Megatron (DTensor); 2d: a q×q grid, SUMMA (tp = q²); 2.5d: tp_depth stacked q×q grids (tp = d·q²);
    # 3d: a q×q×q cube (tp = q³). See distrain/parallel/tpnd/.
    tp_mode: str = "1d"
    tp_depth: int = 1  # 2.5d's d
    # 0: replicated (DDP); 1: optimizer state sharded over dp_shard (ZeroRedundancyOptimizer over DDP);
    # 2: and gradients (FSDP2, parameters kept gathered between forward and backward); 3: and parameters.
    zero: int = 0
    # none | cpu: parameters, gradients, optimizer state and its step in host memory (zero=3 only) |
    # nvme: the same, but the optimizer state in files under nvme_path, streamed (distrain/train/nvme.py)
    offload: str = "none"
    nvme_path: str | None = None  # a directory on a local disk of every node; None: the system's temporary one
    nvme_buffer_mb: float = 256.0  # host memory that streams the optimizer state (3 buffers of a chunk each)
    schedule: str = "1f1b"  # pipeline schedule; see distrain/strategy/pipeline.py
    stages_per_rank: int | None = None  # None: 2 for the multi-stage schedules, else 1
    loss_parallel: bool = True  # with tp: the loss on vocabulary-sharded logits, never gathered
    activation_checkpoint: bool = False  # recompute each block's activations in the backward pass
    compile: bool = False  # torch.compile each block
    bucket_cap_mb: float = 25.0  # DDP gradient buckets

    def nvme_directory(self, run_name: str) -> str:
        """Where offload=nvme puts a run's scratch files on this node."""
        return os.path.join(self.nvme_path or tempfile.gettempdir(), f"distrain-{run_name}")


@dataclass
class PSConfig:
    """A parameter-server run (distrain/ps/) when `mode` is set: `strategy=ps` sets sync, `ps=async`
    (hogwild, easgd) picks another mode. Workers pull weights from and push gradients to
    `num_servers` server actors instead of all-reducing them."""

    mode: str | None = None  # sync | async | hogwild | easgd; None: collective training
    num_servers: int = 1  # server actors, each holding an equal slice of the parameters and their optimizer state
    backup_workers: int = 0  # sync: each step applies the first num_workers − backup_workers gradients
    max_staleness: int | None = None  # async: no gradient is applied more than this many versions late
    tau: int = 4  # easgd: local steps between elastic exchanges
    alpha: float | None = None  # easgd: the elastic coefficient; None: 0.9 / num_workers (β/p in the paper)

    def elastic_alpha(self, num_workers: int) -> float:
        return self.alpha if self.alpha is not None else 0.9 / num_workers


@dataclass
class DataConfig:
    name: str = "stdlib"  # a label for the corpus (runs, W&B); path decides what is read
    path: str | None = None  # a directory or glob of text files; None: the running Python's stdlib source
    val_fraction: float = 0.05
    # Token shards written by jobs/prepare_data.py (their tokenizer inside); when set, training reads them,
    # not `path`. prepare_data.py writes here.
    shards: str | None = None
    text_field: str = "text"  # the field holding a document's text in JSONL files


@dataclass
class TokenizerConfig:
    """How text becomes tokens: bytes (vocabulary 256, nothing to train), or a byte-level BPE (Hugging Face
    `tokenizers`) that jobs/prepare_data.py trains on the corpus or loads from `path`."""

    # bytes | bpe | None: the tokenizer stored with data.shards, else the one at `path`, else bytes
    name: str | None = None
    path: str | None = None  # bpe: a tokenizer.json, or a directory holding one (an imported model's); None: train one
    vocab_size: int = 8192  # bpe: the vocabulary prepare_data.py trains


@dataclass
class OptimConfig:
    """AdamW by default; conf/optim/sgd.yaml and muon.yaml hold what SGD and Muon change."""

    name: str = "adamw"  # adamw | sgd | muon (Muon on the blocks' matrices, AdamW on the rest: docs/optimizers.md)
    lr: float = 3e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.0  # sgd's, and muon's (its preset: 0.95, Nesterov)
    ns_steps: int = 5  # muon: Newton–Schulz steps orthogonalising each matrix's update
    muon_params: str = "blocks"  # muon: blocks (the blocks' matrices) | matrices (every matrix: embeddings, head)
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at decay_steps
    decay_steps: int | None = None  # the schedule's length; None: trainer.max_steps
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still logged)


@dataclass
class ClusterConfig:
    address: str | None = None  # None: RAY_ADDRESS if set, else an embedded local cluster
    connect_timeout_s: float = 10.0  # attaching gives up when the address does not answer within this
    # The embedded local cluster's size; None: this machine's CPUs and GPUs. Ignored when attaching.
    local_cpus: int | None = None
    local_gpus: int | None = None
    num_workers: int = 2
    use_gpu: bool | None = None  # None: one GPU per worker if the cluster has GPUs
    cpus_per_worker: float = 0.25  # a fraction lets several CPU workers share a core
    threads_per_worker: int = 1
    # Variables every worker gets, beside those forwarded from the driver's environment (WANDB_*, NCCL_*,
    # GLOO_*, TORCH_*, CUDA_*): on a cluster, workers do not share the driver's environment.
    env_vars: dict[str, str] = field(default_factory=dict)
    placement_strategy: str = "PACK"
    placement_timeout_s: float = 120.0  # to place the workers; after a node loss, to place all of them again
    # Fault tolerance (distrain/cluster/supervisor.py; docs/fault-tolerance.md).
    spares: int = 0  # hot spares: started with the group, imports warm, each ready to take a dead rank
    # After a failure, the ranks start again from the state a surviving data-parallel replica keeps in memory,
    # not from the last checkpoint, when one holds every shard (docs/fault-tolerance.md): only the step in
    # flight is done again. false: always from the checkpoint.
    peer_recovery: bool = True
    # Keep a run's workers (placement group and warm processes), and its parameter servers, for this
    # driver's next run of the same shape, e.g. a sweep in one process; they hold their resources until
    # then or until room is needed.
    reuse_workers: bool = False
    # What a failure means (distrain/cluster/policy.py): a shipped policy by name, or a FailurePolicy subclass
    # of your own, `cluster.policy._target_=pkg.module.Class` (the command line's name for a dotted path here).
    policy: str = "default"
    max_failures: int = 3  # worker failures (deaths, errors, hangs) survived by restarting; -1: no limit
    min_workers: int | None = None  # the fewest workers a run may shrink to after losing nodes; None: num_workers
    hang_timeout_s: float | None = None  # no step for this long is a hang; None: 10 median steps, at least 60 s
    # The same outside steps: start-up, checkpoint load and save, evaluation; and how long a restart waits for a run's
    # object store that does not answer.
    setup_timeout_s: float = 600.0
    # How long a collective of a training step waits for the other ranks before the attempt fails; outside
    # steps (start-up, checkpoints, evaluation) at least setup_timeout_s, which the supervisor allows there:
    # a slow checkpoint write on one rank must not fail the others waiting for it at a barrier.
    collective_timeout_s: float = 600.0
    restart_backoff_s: float = 1.0  # first wait between retries that make no progress; doubles up to 60 s
    stop_grace_s: float | None = None  # on SIGTERM, time to checkpoint and exit; None: see driver/stop.stop_grace_s
    node_check_s: float = 5.0  # how often to look for draining nodes, and (shrunk) for room to grow back


@dataclass
class TrainerConfig:
    max_steps: int = 300
    global_batch_size: int = 32
    micro_batch_size: int = 8
    seq_len: int = 128
    seed: int = 0
    log_interval: int = 1
    eval_interval: int = 100  # 0 disables periodic validation (a final one still runs)
    eval_batches: int = 4
    precision: str = "auto"  # auto: bf16 autocast on GPU, fp32 on CPU | fp32 | bf16
    # The head and loss over this many tokens of a micro-batch at a time, so its whole logits are never held
    # (distrain/parallel/chunked_loss.py); 0: all at once.
    loss_chunk: int = 0
    # none | tensorwise | rowwise: the blocks' nn.Linear matmuls in float8 with that scaling (torchao; a GPU of
    # compute capability ≥ 8.9, emulated on CPUs): distrain/strategy/float8.py
    float8: str = "none"
    # Refuse a run whose estimated memory per rank (`--plan`) exceeds its devices' (distrain/driver/fits.py).
    check_memory: bool = True


@dataclass
class CheckpointConfig:
    interval: int = 100  # steps between checkpoints; 0: only at the end
    keep: int = 2  # committed checkpoints kept; older ones go only after a newer one commits
    # Written in the background (`checkpoint.async=` on the command line): the step waits only while the
    # state is copied into host memory. false: the step waits for the whole write (less host memory).
    async_save: bool = True


@dataclass
class WandbConfig:
    mode: str | None = None  # None: online with an API key, else offline | online | offline | disabled
    project: str = "distrain"
    entity: str | None = None
    log_checkpoints: bool = False  # each committed checkpoint as a W&B artifact (a reference to its directory)


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    tensorboard: bool = False  # also the metrics as TensorBoard scalars in <run>/tensorboard/ (the tensorboard extra)
    progress_interval_s: float = 5.0  # console progress line period when stdout is not a terminal


@dataclass
class RunConfig:
    name: str = "${model.name}-${strategy.name}-${now:%Y%m%d-%H%M%S}"
    storage: str = "runs"
    objective: str = "val_loss"  # what a sweep's point returns to the sweeper: its final val_loss, or loss


@dataclass
class StorageConfig:
    """How runs reach an object store (run.storage=s3://…, data.shards=s3://…; docs/object-storage.md). Credentials
    are never here: the filesystem reads them from the environment or its config files."""

    # fsspec's options for the filesystem (s3fs: endpoint_url, client_kwargs...); redacted wherever a config is
    # recorded. An S3-compatible server: +storage.options.endpoint_url=http://host:port
    options: dict[str, Any] = field(default_factory=dict)
    cache_dir: str = "~/.cache/distrain"  # each node's local mirror of runs and shards on an object store
    retries: int = 4  # each operation, with back-off doubling from backoff_s, before it fails
    backoff_s: float = 0.5
    # A bucket that does not exist is refused (a misspelt name; some stores would make it on the first write); true
    # makes it before the run (or prepare_data's, export's output) writes there.
    create_bucket: bool = False
    sync_interval_s: float = 30.0  # the run record (metrics, summary, logs) uploaded at least this often


@dataclass
class FaultConfig:
    """Faults injected on purpose, for tests and benchmarks; none by default."""

    straggler: int | None = (
        None  # this rank sleeps after each step until the step took straggler_slowdown × its compute
    )
    straggler_slowdown: float = 3.0
    hold_file: str | None = None  # while it exists, every rank waits before each step (<it>.held.<rank> while it does)
    # Rank kill_rank SIGKILLs its own process once step kill_at_step is done (its checkpoint, if due, begun), in an
    # attempt that began at step 0: a kill at a known step, with no race against a fast run (jobs/gpu_check.py).
    kill_at_step: int | None = None
    kill_rank: int = 0
    # With run.storage a URL: the kill happens instead while step kill_at_step's checkpoint is being uploaded, once
    # rank kill_rank's first object is on the store (a torn checkpoint there: storage/remote.py).
    kill_mid_upload: bool = False
    # Rank kill_rank SIGKILLs itself halfway through the state transfer of the run's first recovery from replicas.
    kill_mid_transfer: bool = False
    # The kill happens instead right after step kill_at_step's backward, once the step before's logged loss has reached
    # every rank and before rank kill_rank writes it (rank 0 of a data-parallel run: only the others hold that line).
    kill_after_backward: bool = False
    # Instead of a kill, every rank raises right after step kill_at_step's optimizer update, before the step counts as
    # done: a failure inside the update everywhere (an out-of-memory there, say), which leaves no rank a whole state.
    fail_in_update: bool = False
    # Every rank that fails takes this many seconds more on its way back (as on a loaded machine its teardown does):
    # the supervisor must wait for it rather than end it, or its state for a recovery from replicas goes too.
    slow_return_s: float = 0.0


# What finetune.lora.targets may name: groups of a block's projections, one projection by its name, or a mixture of
# experts' routed experts (LORA_EXPERTS: the block's `feed_forward.experts`, w1, w2 and w3 of every expert).
LORA_GROUPS = {"attention": "attention", "mlp": "feed_forward"}  # target → the block's module holding them
LORA_PROJECTIONS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
LORA_EXPERTS = "experts"


@dataclass
class LoRAConfig:
    """Low-rank adapters (Hu et al. 2021; distrain/model/lora.py): each targeted nn.Linear of the blocks keeps its
    weight frozen and learns W + (alpha / rank)·B·A, A (rank, in) and B (out, rank). docs/huggingface.md."""

    rank: int = 0  # 0: no adapters, every parameter trained
    alpha: float = 16.0
    dropout: float = 0.0  # on the adapter's input only, as PEFT's lora_dropout
    # attention (wq, wk, wv, wo), mlp (w1, w2, w3; a MoE block's shared experts), projections by name, or experts
    # (a MoE block's routed experts: an adapter per expert on each of its w1, w2, w3)
    targets: list[str] = field(default_factory=lambda: ["attention", "mlp"])

    def adapts(self, module: str) -> bool:
        """Whether the nn.Linear named `module` (layers.{i}.{attention|feed_forward}[.…].{projection}) is one `targets`
        names: by its group (attention, mlp) or its own name (wq, …); or, named layers.{i}.feed_forward.experts, a
        block's routed experts, only by `experts`. A mixture of experts' router never is."""
        parts = module.split(".")
        if self.rank == 0 or len(parts) < 4 or parts[0] != "layers" or parts[-1] == "router":
            return False
        if parts[2:] == ["feed_forward", LORA_EXPERTS]:
            return LORA_EXPERTS in self.targets
        return any(parts[-1] == t or LORA_GROUPS.get(t) == parts[2] for t in self.targets)


@dataclass
class FinetuneConfig:
    lora: LoRAConfig = field(default_factory=LoRAConfig)


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    ps: PSConfig = field(default_factory=PSConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    plan: bool = False  # print the layout (mesh, process groups, memory per rank) and exit without training

    @property
    def run_dir(self) -> str:
        """Where this process reads and writes the run: run.storage/run.name, or for an object store its
        local mirror (storage/objectstore.py), which `run_url` is the durable copy of."""
        if self.run_url:
            return str(mirror_dir(self.run_url, self.storage.cache_dir))
        return os.path.join(self.run.storage, self.run.name)

    @property
    def run_url(self) -> str | None:
        """The run on an object store (run.storage=s3://…), else None."""
        return run_location(self.run.storage, self.run.name) if is_url(self.run.storage) else None


def attach_address(address: str | None) -> str | None:
    """The existing cluster to attach to: `address`, else RAY_ADDRESS (how `ray job submit` runs
    us); None (or "local") means an embedded cluster on this machine."""
    address = address or os.environ.get("RAY_ADDRESS")
    return None if address in (None, "", "local") else address


def resolve_precision(precision: str, gpu: bool) -> str:
    """`auto` is bf16 (autocast, fp32 master weights) on GPUs and fp32 on CPUs."""
    return ("bf16" if gpu else "fp32") if precision == "auto" else precision


def to_plain(cfg: Any) -> dict:
    """A resolved plain dict: what crosses into Ray actors (no Hydra or OmegaConf there)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def recorded(plain: dict) -> dict:
    """A plain config as it may be recorded (a checkpoint's meta.json, W&B, the Hydra record): storage.options
    redacted, should a secret have been put there."""
    return {**plain, "storage": {**plain["storage"], "options": redact(plain["storage"]["options"])}}


def from_plain(d: dict, cls: type = TrainConfig) -> Any:
    """The dataclasses back from `to_plain`'s dict, without OmegaConf: a worker does this as it starts
    (OmegaConf's structured merge took 0.2 s there, on the way to the first step after a failure)."""
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in d:
            group = f.default_factory if dataclasses.is_dataclass(f.default_factory) else None
            values[f.name] = from_plain(d[f.name], group) if group else d[f.name]
    return cls(**values)
