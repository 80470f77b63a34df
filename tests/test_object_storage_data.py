"""Token shards and exported models on an object store (issue 33), against a real S3 server (SeaweedFS, the
`s3` fixture): jobs/prepare_data.py uploads to a URL, its index last; a run trains from `data.shards=s3://…`
exactly as from the same shards on disk, each node fetching them once into its cache, which mends itself; a URL
without shards is refused in one line before any worker starts; jobs/export.py writes to a URL the bytes it
writes to a folder."""

from __future__ import annotations

import json
import shutil
import threading
import uuid
import zlib
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import REPO, free_port, logged, make_config

from distrain.commands.export import export, export_to  # noqa: E402
from distrain.commands.export import main as export_job  # noqa: E402
from distrain.commands.prepare_data import main as prepare_data  # noqa: E402
from distrain.config import ConfigError, StorageConfig
from distrain.data.corpus import stdlib_files
from distrain.data.remote import fetch
from distrain.data.shards import read_index
from distrain.driver.launch import train
from distrain.storage.objectstore import Store
from distrain.storage.publish import staged

STEPS = 4


def config(tmp: Path, s3, shards: str, *overrides: str):
    """A 2-worker byte-shards run; the workers get the store's credentials and endpoint from cluster.env_vars."""
    env = [f"+cluster.env_vars.{k}={v}" for k, v in s3.env.items()]
    return make_config(
        tmp, f"data.shards={shards}", f"storage.cache_dir={tmp}/cache", "cluster.num_workers=2",
        f"trainer.max_steps={STEPS}", "model.vocab_size=257", *env, *overrides,
    )  # fmt: skip


@pytest.fixture(scope="module")
def shards(s3, tmp_path_factory) -> tuple[str, Path]:
    """Byte shards of ~200 kB of the standard library, prepared by the job straight to a URL; and a plain
    copy of what the store holds there (fsspec's own download), to train from locally."""
    corpus = tmp_path_factory.mktemp("corpus")
    for i, f in enumerate(stdlib_files()[10:30]):
        (corpus / f"{i:02d}.py").write_bytes(Path(f).read_bytes())
    url = s3.url(f"shards-{uuid.uuid4().hex[:8]}")
    cache = tmp_path_factory.mktemp("prepare-cache")
    prepare_data([f"data.path={corpus}", f"data.shards={url}", f"storage.cache_dir={cache}"])
    assert not any((cache / "staging").iterdir())  # the temporary folder is gone
    local = tmp_path_factory.mktemp("local") / "shards"
    store = Store(url)
    store.fs.get(store.root + "/", str(local), recursive=True)
    return url, local


@pytest.fixture(scope="module")
def runs(shards, s3, tmp_path_factory, ray_cluster) -> dict:
    """The same run trained from the local copy and from the URL."""
    url, local = shards
    tmp = tmp_path_factory.mktemp("runs")
    cfgs = {"local": config(tmp, s3, str(local), "run.name=local"), "url": config(tmp, s3, url, "run.name=url")}
    for cfg in cfgs.values():
        assert train(cfg)["final_step"] == STEPS
    return cfgs


def test_the_job_uploads_every_shard_with_its_checksum(shards, capsys):
    url, local = shards
    index = read_index(local)
    files = [s for split in ("train", "val") for s in index["splits"][split]["shards"]]
    assert files and all(s["crc32"] == zlib.crc32((local / s["file"]).read_bytes()) for s in files)
    assert {"index.json", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in local.iterdir()}
    failed = pytest.raises(SystemExit, prepare_data, [f"data.path={REPO}/distrain", f"data.shards={url}"])
    assert failed.value.code == 2  # a complete output is never overwritten
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds a complete output" in err, err


def test_a_cut_upload_never_shows_its_last_file(tmp_path: Path):
    """The upload fails on one file (a folder stands where it goes): the index, sent last, is not there."""
    dest = tmp_path / "dest"
    (dest / "train_000001.bin").mkdir(parents=True)
    storage = StorageConfig(cache_dir=str(tmp_path / "cache"), retries=0)
    with pytest.raises(ConfigError, match="the upload failed, index.json not written") as e:
        with staged(f"file://{dest}", storage, ("index.json",), "data.shards") as out:
            out.mkdir()
            for name in ("index.json", "train_000000.bin", "train_000001.bin"):
                (out / name).write_bytes(b"x")
    assert "\n" not in str(e.value)
    assert not (dest / "index.json").exists() and (dest / "train_000000.bin").is_file()


def test_a_run_from_a_url_trains_on_the_same_tokens(runs, shards):
    url, local = shards
    assert logged(runs["url"]) == logged(runs["local"])  # bitwise
    assert logged(runs["url"], "grad_norm") == logged(runs["local"], "grad_norm")
    cache = Path(runs["url"].storage.cache_dir) / "mirror"
    (cached,) = [p.parent for p in cache.rglob("index.json")]
    for f in local.iterdir():
        assert (cached / f.name).read_bytes() == f.read_bytes(), f.name


def test_a_node_fetches_once_and_mends_a_damaged_cache(shards, tmp_path: Path):
    url, local = shards
    storage = StorageConfig(cache_dir=str(tmp_path))
    fetched: list[list[str]] = []
    ranks = [threading.Thread(target=lambda: fetched.append(fetch(url, storage)[1])) for _ in range(3)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(timeout=60)
    everything = sorted(p.name for p in local.iterdir() if p.name != "index.json")
    assert sorted(sum(fetched, [])) == everything  # each file once, by one of the ranks sharing the cache
    cache, again = fetch(url, storage)
    assert again == []
    with open(cache / "train_000000.bin", "r+b") as f:  # damaged in place: the same size
        f.seek(100)
        f.write(b"\xff\xfe")
    with open(cache / "val_000000.bin", "r+b") as f:
        f.truncate(7)
    (cache / "tokenizer.json").unlink()
    assert sorted(fetch(url, storage)[1]) == ["tokenizer.json", "train_000000.bin", "val_000000.bin"]
    for f in local.iterdir():
        assert (cache / f.name).read_bytes() == f.read_bytes(), f.name


def test_a_shard_damaged_on_the_store_is_refused_not_trained_on(shards, s3, tmp_path: Path):
    """Bytes of a shard overwritten on the store itself (its size unchanged): the fetch checks what it downloaded
    against the index's checksum and refuses in one line, rather than training on the damage."""
    url, local = shards
    damaged = Store(s3.url(f"damaged-{uuid.uuid4().hex[:8]}"))
    damaged.upload(local, [p.name for p in local.iterdir()], "")
    data = bytearray((local / "train_000000.bin").read_bytes())
    data[100:102] = b"\xff\xfe" if data[100:102] != b"\xff\xfe" else b"\x00\x01"
    damaged.write_bytes("train_000000.bin", bytes(data))
    with pytest.raises(ConfigError, match="train_000000.bin as fetched does not match its index") as e:
        fetch(damaged.url, StorageConfig(cache_dir=str(tmp_path)))
    assert "\n" not in str(e.value) and damaged.url in str(e.value)


def test_an_index_without_checksums_still_fetches(shards, s3, tmp_path: Path):
    """Shards prepared before the index recorded CRC-32s: checked by size."""
    url, local = shards
    old = Store(s3.url(f"old-{uuid.uuid4().hex[:8]}"))
    index = json.loads((local / "index.json").read_text())
    for split in index["splits"].values():
        for shard in split["shards"]:
            del shard["crc32"]
    old.upload(local, [p.name for p in local.iterdir() if p.name != "index.json"], "")
    old.write_bytes("index.json", json.dumps(index).encode())
    cache, fetched = fetch(old.url, StorageConfig(cache_dir=str(tmp_path)))
    assert len(fetched) == 4 and read_index(cache) == index


def test_a_url_without_shards_is_refused_in_one_line_before_any_worker(shards, s3, tmp_path: Path):
    url, local = shards
    partial = s3.url(f"partial-{uuid.uuid4().hex[:8]}")
    Store(partial).write_bytes("index.json", (local / "index.json").read_bytes())  # an index without its shards
    fast = {"connect_timeout": 1, "retries": {"max_attempts": 1}}  # a closed port fails at once
    unreachable = StorageConfig(
        options={"endpoint_url": f"http://127.0.0.1:{free_port()}", "config_kwargs": fast}, retries=0
    )
    cases = (
        (s3.url("nothing-here"), None, "has no index.json: not prepared"),
        (partial, None, "is corrupt .*train_000000.bin is missing"),
        (url, unreachable, "cannot be read"),
        ("nosuchfs://bucket/shards", None, "no filesystem for nosuchfs://"),
    )
    for shards_url, storage, message in cases:
        cfg = config(tmp_path, s3, shards_url, "run.name=refused")
        cfg = replace(cfg, storage=storage or cfg.storage)
        with pytest.raises(ConfigError, match=message) as e:
            train(cfg)
        assert "\n" not in str(e.value) and shards_url in str(e.value), str(e.value)
    assert not (tmp_path / "refused").exists() and not (tmp_path / "cache").exists()


def test_an_export_to_a_url_is_the_local_export(runs, s3, tmp_path: Path):
    run_dir = runs["url"].run_dir  # its tokenizer comes from the shards' URL
    out, step = export(run_dir, tmp_path / "local")
    url = s3.url(f"export-{uuid.uuid4().hex[:8]}")
    storage = StorageConfig(cache_dir=str(tmp_path / "cache"))
    assert export_to(run_dir, url, storage=storage) == (url, step)
    store = Store(url)
    assert sorted(store.listing()) == sorted(p.name for p in out.iterdir())
    for f in out.iterdir():
        assert store.read_bytes(f.name) == f.read_bytes(), f.name
    with pytest.raises(ConfigError, match="already holds a complete output"):
        export_to(run_dir, url, storage=storage)
    shutil.rmtree(out)


def test_an_output_into_a_bucket_that_does_not_exist_is_refused_unless_made(s3, tmp_path: Path, capsys):
    """A misspelt bucket, which SeaweedFS would make at the first upload: prepare_data and export refuse it in one
    line naming it, before anything is written; storage.create_bucket=true (an argument of export's) makes it."""
    made = lambda: Store(s3.url()).fs.ls("", refresh=True)  # noqa: E731  (the store's buckets)
    bucket = f"nosuchbucket-{uuid.uuid4().hex[:8]}"
    for job, args, key, where in [
        (prepare_data, [f"storage.cache_dir={tmp_path}"], "data.shards", "shards"),
        (export_job, ["run.name=r", f"run.storage={tmp_path}"], "out", "hf"),
    ]:
        url = f"s3://{bucket}/{where}"
        with pytest.raises(SystemExit) as refused:
            job([*args, f"{key}={url}"])
        line = f"{key}={url!r}: the bucket '{bucket}' does not exist; check its name, or set storage.create_bucket=true"
        assert refused.value.code == 2 and capsys.readouterr().err == f"distrain: error: {line} to create it\n"
    assert bucket not in made() and list(tmp_path.iterdir()) == []

    with pytest.raises(SystemExit):  # the flag reaches the check: the bucket is made, then the run is not found
        export_job(["run.name=r", f"run.storage={tmp_path}", f"out=s3://{bucket}/hf", "storage.create_bucket=true"])
    assert "no run at" in capsys.readouterr().err and bucket in made() and Store(f"s3://{bucket}").listing() == {}
    other = f"s3://nosuchbucket-{uuid.uuid4().hex[:8]}/shards"
    with staged(
        other, StorageConfig(cache_dir=str(tmp_path), create_bucket=True), ("index.json",), "data.shards"
    ) as out:
        out.mkdir()
        (out / "index.json").write_text("{}")
    assert Store(other).read_bytes("index.json") == b"{}"

    fast = {"connect_timeout": 1, "retries": {"max_attempts": 1}}  # a closed port: the bucket's look fails at once
    options = {"endpoint_url": f"http://127.0.0.1:{free_port()}", "config_kwargs": fast}
    closed = StorageConfig(options=options, retries=0)
    with pytest.raises(ConfigError, match=rf"^data.shards={other} cannot be written: looking up the bucket of"):
        with staged(other, closed, ("index.json",), "data.shards"):
            pass
