"""A trained run as a Hugging Face model directory:

    distrain export run.name=NAME out=DIR [run.storage=runs] [step=N] [storage.create_bucket=false]
    (a checkout: python jobs/export.py run.name=NAME out=DIR [...])

DIR (or a URL: s3://bucket/prefix, any fsspec URL, with the environment's credentials and endpoint) gets
config.json, model.safetensors (float32) and the run's tokenizer files, which
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` load.
From the newest checkpoint that verifies (or step N's, if it does), whatever layout wrote it; the step
exported is said. DIR is never overwritten: the files are written beside it and the directory renamed into
place once whole; to a URL they are written to a temporary folder and uploaded, config.json last (a model
without it does not load), and a URL holding a config.json is never written to, nor one whose bucket does not
exist (storage.create_bucket=true makes it).
Bad input: one line and exit status 2."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

from distrain.config import ConfigError, StorageConfig

ARGUMENTS = "run.name=NAME out=DIR|URL [run.storage=runs] [step=N] [storage.create_bucket=false]"


def export(run_dir: str | Path, out: str | Path, step: int | None = None) -> tuple[Path, int]:
    """Write the run's model and tokenizer to `out` (absent or empty) as a Hugging Face directory; returns
    `out` and the step of the checkpoint exported."""
    from safetensors.torch import save_file

    from distrain.data.tokenizer import run_tokenizer
    from distrain.driver.trained import checkpoint_path, load_trained
    from distrain.model.hf import hf_config, to_hf
    from distrain.storage.checkpoint import read_meta

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"out={out} exists and is not empty; give a new directory (export never overwrites)")
    step = read_meta(checkpoint_path(run_dir, step))["step"]  # the one load_trained loads: checked once
    cfg, model = load_trained(run_dir, step)
    tokenizer = run_tokenizer(cfg)
    config = hf_config(cfg.model, cfg.trainer.seq_len) | {
        "bos_token_id": tokenizer.eos_id,
        "eos_token_id": tokenizer.eos_id,
    }
    tensors = to_hf({k: v.detach() for k, v in model.state_dict().items()}, cfg.model)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.export-{uuid.uuid4().hex[:8]}"
    try:
        staging.mkdir()
        (staging / "config.json").write_text(json.dumps(config, indent=1))
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        readable(staging / "model.safetensors")
        tokenizer.save(staging)
        if out.exists():
            out.rmdir()  # empty (checked above)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out, step


def export_to(
    run_dir: str | Path, out: str, step: int | None = None, storage: StorageConfig | None = None
) -> tuple[str, int]:
    """`export` to a local directory, or to a URL through a temporary folder under `storage.cache_dir`,
    config.json uploaded last."""
    from distrain.storage.publish import staged
    from distrain.urls import is_url

    if not is_url(out):
        path, step = export(run_dir, out, step)
        return str(path), step
    with staged(out, storage or StorageConfig(), "config.json", "out") as local:
        return out, export(run_dir, local, step)[1]


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
        out, step = export_to(run, args["out"], args["step"], storage)
        return f"distrain: exported run {args['run.name']} at step {step} to {out}"

    spec = {
        "run.name": (str, REQUIRED),
        "run.storage": (Location, "runs"),
        "out": (Location, REQUIRED),
        "step": (int, None),
        "storage.create_bucket": (boolean, False),
    }
    run_job(argv, spec, f"{how('export')} {ARGUMENTS}", work)
