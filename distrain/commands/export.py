"""A trained run as a Hugging Face model directory:

    distrain export run.name=NAME out=DIR [run.storage=runs] [step=N] [storage.create_bucket=false] [merge=false]
    (a checkout: python jobs/export.py run.name=NAME out=DIR [...])

DIR (or a URL: s3://bucket/prefix, any fsspec URL, with the environment's credentials and endpoint) gets
config.json, model.safetensors (float32) and the run's tokenizer files, which
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` load.
From the newest checkpoint that verifies (or step N's, if it does), whatever layout wrote it; the step
exported is said. DIR is never overwritten: the files are written beside it and the directory renamed into
place once whole; to a URL they are written to a temporary folder and uploaded, config.json last (a model
without it does not load), and a URL holding a config.json is never written to, nor one whose bucket does not
exist (storage.create_bucket=true makes it).
A LoRA run (finetune.lora) exports its adapter alone, as PEFT saves one (adapter_config.json,
adapter_model.safetensors; `peft.PeftModel.from_pretrained(base, DIR)` loads it onto the base model), or
with merge=true the base model with the adapter added into its weights.
Bad input: one line and exit status 2."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

from distrain.config import ConfigError, StorageConfig

ARGUMENTS = "run.name=NAME out=DIR|URL [run.storage=runs] [step=N] [storage.create_bucket=false] [merge=false]"


def export(run_dir: str | Path, out: str | Path, step: int | None = None, merge: bool = False) -> tuple[Path, int]:
    """Write the run's model and tokenizer to `out` (absent or empty) as a Hugging Face directory; returns
    `out` and the step of the checkpoint exported. A LoRA run's (finetune.lora) is its adapter alone, as PEFT
    saves one, or with `merge` the base model with the adapter added into its weights."""
    from safetensors.torch import save_file

    from distrain.data.tokenizer import run_tokenizer
    from distrain.driver.trained import checkpoint_path, load_trained
    from distrain.model.hf import hf_config, to_hf
    from distrain.model.lora_hf import adapter_files, merged_state
    from distrain.storage.checkpoint import read_meta

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"out={out} exists and is not empty; give a new directory (export never overwrites)")
    step = read_meta(checkpoint_path(run_dir, step))["step"]  # the one load_trained loads: checked once
    cfg, model = load_trained(run_dir, step)
    lora = cfg.finetune.lora  # merge=true on a run without adapters: nothing to merge, the model as it is
    tokenizer = run_tokenizer(cfg)
    if lora.rank and not merge:
        config, tensors = adapter_files(model, cfg.model, lora, cfg.model.init_from)
    else:
        config = hf_config(cfg.model, cfg.trainer.seq_len) | {
            "bos_token_id": tokenizer.eos_id,
            "eos_token_id": tokenizer.eos_id,
        }
        state = merged_state(model) if lora.rank else {k: v.detach() for k, v in model.state_dict().items()}
        tensors = to_hf(state, cfg.model)
    config_file, weights_file = files(adapter=bool(lora.rank and not merge))
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.export-{uuid.uuid4().hex[:8]}"
    try:
        staging.mkdir()
        (staging / config_file).write_text(json.dumps(config, indent=1))
        save_file(tensors, str(staging / weights_file), metadata={"format": "pt"})
        readable(staging / weights_file)
        tokenizer.save(staging)
        if out.exists():
            out.rmdir()  # empty (checked above)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out, step


def files(adapter: bool) -> tuple[str, str]:
    """The config's and the weights' file names: a model's, or PEFT's of an adapter alone."""
    return ("adapter_config.json", "adapter_model.safetensors") if adapter else ("config.json", "model.safetensors")


def export_to(
    run_dir: str | Path, out: str, step: int | None = None, storage: StorageConfig | None = None, merge: bool = False
) -> tuple[str, int]:
    """`export` to a local directory, or to a URL through a temporary folder under `storage.cache_dir`, its config
    file uploaded last."""
    from distrain.storage.publish import staged
    from distrain.urls import is_url

    if not is_url(out):
        path, step = export(run_dir, out, step, merge)
        return str(path), step
    configs = (files(adapter=False)[0], files(adapter=True)[0])  # a model's or an adapter's: either marks it whole
    with staged(out, storage or StorageConfig(), configs, "out") as local:
        return out, export(run_dir, local, step, merge)[1]


def readable(path: Path) -> None:
    """safetensors writes its file 0600: give it the mode any other new file gets (0666 less the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def main(argv: list[str]) -> None:
    from distrain.commands import helped, how
    from distrain.driver.jobargs import REQUIRED, Location, boolean, run_job

    if helped(argv, __doc__):
        return
    from distrain.urls import run_location

    def work(args: dict) -> str:
        run = run_location(args["run.storage"], args["run.name"])
        storage = StorageConfig(create_bucket=args["storage.create_bucket"])
        out, step = export_to(run, args["out"], args["step"], storage, args["merge"])
        return f"distrain: exported run {args['run.name']} at step {step} to {out}"

    spec = {
        "run.name": (str, REQUIRED),
        "run.storage": (Location, "runs"),
        "out": (Location, REQUIRED),
        "step": (int, None),
        "storage.create_bucket": (boolean, False),
        "merge": (boolean, False),
    }
    run_job(argv, spec, f"{how('export')} {ARGUMENTS}", work)
