"""A trained model in one process: a run's committed checkpoint, whatever layout wrote it (DDP, FSDP, TP,
PP: full-model names in DCP; or the parameter server's shards), into one whole model on the CPU. What
jobs/export.py and jobs/generate.py start from; no process group, no Ray."""

from __future__ import annotations

import warnings
from pathlib import Path

from torch import nn

from distrain.config import ConfigError, StorageConfig, TrainConfig, from_plain
from distrain.model.contract import fill_parameters
from distrain.model.hf import hf_weights
from distrain.model.lora import add_adapters, is_adapter
from distrain.model.registry import build_model
from distrain.storage import checkpoint, remote, safeload
from distrain.urls import is_url


def checkpoint_path(run_dir: str | Path, step: int | None = None, storage: StorageConfig | None = None) -> Path:
    """The newest checkpoint of the run that verifies (or `step`'s, if it does); a one-line ConfigError when
    there is none. A newer one skipped as damaged is said in one line on stderr. A run on an object store
    (`run_dir` a URL) is read from there: the checkpoint is downloaded into the local mirror (`storage`)."""
    if is_url(str(run_dir)):
        return _fetched(str(run_dir), step, storage or StorageConfig())
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"run.name: no run at {run_dir}; give the run.name (and run.storage) of a run that trained")
    root = run_dir / "checkpoints"
    if step is not None:
        path = checkpoint.step_dir(root, step)
        why = checkpoint.problem(path) if path.is_dir() else "there is none"
        if why is not None:
            whole = [checkpoint.read_meta(p)["step"] for p in checkpoint.checkpoints(root) if not checkpoint.problem(p)]
            raise ConfigError(
                f"step={step}: run {run_dir.name} has no committed checkpoint of it that verifies ({why}); "
                f"committed and whole: {sorted(whole)}"
            )
        return path
    try:
        path = checkpoint.latest(root)
    except safeload.DamagedCheckpointError as e:
        raise ConfigError(str(e)) from None
    if path is None:
        raise ConfigError(
            f"run {run_dir.name} has no committed checkpoint yet: train it (a checkpoint commits every "
            f"checkpoint.interval steps and at the end)"
        )
    return path


def _fetched(url: str, step: int | None, storage: StorageConfig) -> Path:
    store, mirror = remote.mirror_of(url, storage)
    try:
        path = remote.fetch(store, mirror, step, only=step is not None)
    except safeload.DamagedCheckpointError as e:
        raise ConfigError(str(e)) from None
    if path is None:
        which = f"of step={step}" if step is not None else "yet"
        raise ConfigError(f"run {url} has no committed checkpoint {which} on the object store")
    return path


def load_trained(
    run_dir: str | Path, step: int | None = None, storage: StorageConfig | None = None
) -> tuple[TrainConfig, nn.Module]:
    """The run's config (as its checkpoint holds it) and its model, built with the registry and filled
    with the weights of the newest checkpoint that verifies (or `step`'s), in eval mode on the CPU."""
    path = checkpoint_path(run_dir, step, storage)
    meta = checkpoint.read_meta(path)
    cfg = from_plain(meta["config"])
    model = build_model(cfg.model, cfg.trainer.seq_len, seed=cfg.trainer.seed)
    add_adapters(model, cfg.finetune.lora, cfg.trainer.seed)
    if "ps" in meta:  # the parameter server's own files
        from distrain.ps.server import load_weights

        load_weights(path, model)
    else:
        trained = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        state = {"model": {k: v for k, v in model.state_dict().items() if k in trained or not cfg.finetune.lora.rank}}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            safeload.read_state(path, state, no_dist=True)  # as a resume reads it: tensors and plain data only
        if cfg.finetune.lora.rank and cfg.model.init_from:  # a LoRA run's checkpoint holds its adapters alone
            fill_parameters(model, hf_weights(cfg.model.init_from, cfg.model), only=lambda n: not is_adapter(n))
        model.load_state_dict(state["model"], strict=not cfg.finetune.lora.rank)
    return cfg, model.eval()
