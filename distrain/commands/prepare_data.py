"""Text → token shards for training:

    distrain prepare-data data.path=DIR_OR_GLOB tokenizer=bpe data.shards=OUT
        [tokenizer.vocab_size=8192] [tokenizer.path=TOKENIZER] [data.text_field=text] [data.val_fraction=0.05]
    (a checkout: .venv/bin/python jobs/prepare_data.py data.path=... tokenizer=bpe data.shards=OUT [...])

OUT is a new directory, or a URL (s3://bucket/prefix, any fsspec URL): then the shards are written to a
temporary folder under storage.cache_dir and uploaded, their index last (distrain/storage/publish.py).

The same Hydra overrides as `distrain train` (and its --config-dir). Bad input gets one line and exit status 2;
at the end it prints the command that trains on the shards."""

import os
import sys

from distrain.config import ConfigError
from distrain.driver.cli import BadInput, check_flags, compose, overrides_of


def fail(message: str, code: int = 2) -> None:
    print(f"distrain: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def main(argv: list[str]) -> None:
    from hydra._internal.utils import get_args_parser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from distrain.commands import helped, how

    if helped(argv, __doc__):
        return
    try:
        check_flags(argv)
        overrides, config_dir = overrides_of(argv), get_args_parser().parse_known_args(argv)[0].config_dir
        cfg = compose(overrides, config_dir)
    except (BadInput, HydraException, OmegaConfBaseException) as e:
        fail(str(e).strip().splitlines()[0])
    if not cfg.data.shards:
        fail("data.shards is not set: give the directory to write, e.g. data.shards=shards/mycorpus")
    from distrain.data.prepare import prepare
    from distrain.data.shards import INDEX
    from distrain.storage.publish import staged
    from distrain.urls import check_location, is_url

    try:
        check_location(cfg.data.shards, "data.shards")
    except ValueError as e:
        fail(str(e))
    out = cfg.data.shards if is_url(cfg.data.shards) else os.path.abspath(cfg.data.shards)
    try:
        if is_url(out):
            with staged(out, cfg.storage, (INDEX,), "data.shards") as local:
                index = prepare(cfg, local, progress_s=cfg.logger.progress_interval_s)
        else:
            index = prepare(cfg, out, progress_s=cfg.logger.progress_interval_s)
    except ConfigError as e:
        fail(str(e))
    except KeyboardInterrupt:
        written = f"{out} has no {INDEX}: not usable" if is_url(out) else f"nothing was written to {out}"
        fail(f"interrupted; {written}", code=130)
    tok, splits = index["tokenizer"], index["splits"]
    print(
        f"distrain: wrote {out}: {splits['train']['tokens']:,} train and {splits['val']['tokens']:,} validation "
        f"tokens ({index['dtype']}) from {splits['train']['documents'] + splits['val']['documents']:,} documents; "
        f"{tok['kind']} tokenizer of {tok['vocab_size']:,} tokens"
    )
    train = f"{how('train')} data.shards={out} model.vocab_size={tok['vocab_size']}"
    print(f"distrain: train on them with: {train}")
