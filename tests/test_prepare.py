"""Token shards: jobs/prepare_data.py from directories, globs and JSONL, streamed in bounded memory; the
checks that refuse bad shards before any worker starts; training on BPE shards with 1 or 2 workers
and resuming, exactly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, final_weights, logged, make_config

from distrain.config import ConfigError
from distrain.data.checks import check_same_shards
from distrain.data.corpus import stdlib_files
from distrain.data.documents import pieces
from distrain.data.prepare import is_validation, prepare
from distrain.data.shards import dtype_for, open_split, read_index
from distrain.data.tokenizer import EOS, byte_tokenizer_json, load_tokenizer
from distrain.driver.cli import compose
from distrain.driver.launch import train
from distrain.driver.validation import validate

pytest.importorskip("tokenizers")

VOCAB = 320  # a BPE of 256 bytes, its EOS and 63 merges: quick to learn, and every id > 255 is exercised


def shards_of(tmp_path: Path, name: str, *overrides: str, **kwargs) -> tuple[Path, dict]:
    out = tmp_path / name
    return out, prepare(compose([*overrides, f"data.shards={out}"]), out, progress_s=1e9, **kwargs)


def split_tokens(out: Path, split: str) -> np.ndarray:
    return np.concatenate(open_split(out, split))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """About 500 kB of the standard library's source, in a folder with a subfolder."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "sub").mkdir()
    for i, f in enumerate(stdlib_files()[10:40]):
        (root / ("sub" if i % 3 else "") / f"{i:02d}.py").write_bytes(Path(f).read_bytes())
    return root


@pytest.fixture(scope="module")
def bpe_shards(tmp_path_factory, corpus) -> Path:
    """BPE shards of the corpus, several files per split."""
    out, _ = shards_of(
        tmp_path_factory.mktemp("shards"), "bpe", f"data.path={corpus}", "tokenizer=bpe",
        f"tokenizer.vocab_size={VOCAB}", shard_tokens=20_000, piece_bytes=4096,
    )  # fmt: skip
    return out


def test_a_directory_in_byte_shards_is_its_files_dealt_out_by_document(tmp_path: Path, corpus: Path):
    """Bytes: every piece of every file, in order, to the split `is_validation` says, nothing else."""
    out, index = shards_of(tmp_path, "bytes", f"data.path={corpus}", "data.val_fraction=0.2", piece_bytes=4096)
    files = sorted(str(p) for p in corpus.rglob("*.py"))
    units = [p.text.encode() for p in pieces(files, "text", 4096)]
    for split, val in (("train", False), ("val", True)):
        want = b"".join(u for i, u in enumerate(units) if is_validation(i, 0.2) == val)
        assert split_tokens(out, split).astype(np.uint8).tobytes() == want
    assert index["dtype"] == "uint16"
    assert index["splits"]["val"]["documents"] == round(len(units) * 0.2)
    assert load_tokenizer(out).kind == "bytes" and index["source"]["files"] == len(files) == 30


def dealt_out(files: bytes, train: bytes, val: bytes) -> None:
    """`files` is `train` and `val` interleaved, each in order: every byte in exactly one split. Every line
    is unique, so at each point the split that holds what comes next matches the most; a match is taken up
    to its last newline (past it, the split's next piece may share a few bytes with the other's)."""
    p, at = 0, {"train": 0, "val": 0}
    splits = {"train": train, "val": val}
    while p < len(files):
        match = {s: os.path.commonprefix([files[p:], splits[s][at[s] :]]) for s in splits}
        split = max(match, key=lambda s: len(match[s]))
        assert match[split], f"byte {p} of the files ({files[p : p + 40]!r}) is in neither split"
        taken = match[split].rfind(b"\n") + 1 or len(match[split])
        p, at[split] = p + taken, at[split] + taken
    assert at == {s: len(b) for s, b in splits.items()}, "a split holds bytes beyond the files'"


def test_byte_shards_hold_every_byte_of_every_file_once(tmp_path: Path):
    """Checked against the files themselves: the end of a file longer than a piece, a file without a
    final newline, a line longer than a piece, a file of one line."""
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    texts = {
        "a.txt": "".join(f"a {n}: {'x' * (n % 70)}\n" for n in range(300)) + "a, its end without a newline",
        "b.txt": "b: a file of one line\n",
        "sub/c.txt": "c 0\n" + "".join(f"{n:05d}" for n in range(1000)) + "\nc 2, after a long line\n",
    }
    for name, text in texts.items():
        (corpus / name).write_text(text)
    out, _ = shards_of(tmp_path, "bytes", f"data.path={corpus}", "data.val_fraction=0.2", piece_bytes=1024)
    train, val = (split_tokens(out, split) for split in ("train", "val"))
    assert train.max() < 256 and val.max() < 256 and len(val) > 1024
    files = "".join(texts[name] for name in sorted(texts)).encode()
    dealt_out(files, train.astype(np.uint8).tobytes(), val.astype(np.uint8).tobytes())


def test_a_glob_of_jsonl_in_bpe_shards_decodes_to_its_records(tmp_path: Path, bpe_shards: Path):
    """JSONL: one document per record (the text field named), each ended by EOS; the glob takes only
    its files; a BPE loaded from tokenizer.path (here the shards' own) encodes them."""
    records = [{"body": f"record {i}: " + "x = [1, 2, 3]\n" * (i % 5), "id": i} for i in range(40)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:25]))
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in records[25:]))
    (tmp_path / "c.txt").write_text("not matched by the glob")
    out, index = shards_of(
        tmp_path, "out", f"data.path={tmp_path}/*.jsonl", "tokenizer=bpe", f"tokenizer.path={bpe_shards}",
        "data.text_field=body", "data.val_fraction=0.1",
    )  # fmt: skip
    tokenizer = load_tokenizer(out)
    assert tokenizer.fingerprint == load_tokenizer(bpe_shards).fingerprint == index["tokenizer"]["fingerprint"]
    for split, val in (("train", False), ("val", True)):
        text = tokenizer.decode(split_tokens(out, split).tolist())
        want = [r["body"] for i, r in enumerate(records) if is_validation(i, 0.1) == val]
        assert text.split(EOS) == [*want, ""]
    assert index["splits"]["val"]["documents"] == 4 and index["dtype"] == "uint16"


def test_the_split_is_deterministic_and_the_shards_several(tmp_path: Path, bpe_shards: Path, corpus: Path):
    again, index = shards_of(
        tmp_path, "again", f"data.path={corpus}", "tokenizer=bpe", f"tokenizer.vocab_size={VOCAB}",
        shard_tokens=20_000, piece_bytes=4096,
    )  # fmt: skip
    assert index == {**read_index(bpe_shards), "source": index["source"]}
    for f in bpe_shards.glob("*.bin"):
        assert (again / f.name).read_bytes() == f.read_bytes(), f.name
    assert len(index["splits"]["train"]["shards"]) > 3 and len(index["splits"]["val"]["shards"]) > 1
    assert all(s["tokens"] == 20_000 for s in index["splits"]["train"]["shards"][:-1])
    assert split_tokens(bpe_shards, "train").max() >= 256 and index["tokenizer"]["vocab_size"] == VOCAB


def test_uint32_when_the_vocabulary_does_not_fit_uint16(tmp_path: Path):
    tokenizers = pytest.importorskip("tokenizers")
    assert dtype_for(2**16) == np.uint16 and dtype_for(2**16 + 1) == np.uint32
    hf = tokenizers.Tokenizer.from_str(byte_tokenizer_json())
    hf.add_tokens([f"<t{i}>" for i in range(70_000)])
    hf.save(str(tmp_path / "big.json"))
    (tmp_path / "text").mkdir()
    for name in ("a.txt", "b.txt"):  # one document for each split
        (tmp_path / "text" / name).write_text("a<t69999>b<t3>" * 10)
    out, index = shards_of(
        tmp_path, "out", f"data.path={tmp_path}/text", "tokenizer=bpe", f"tokenizer.path={tmp_path}/big.json",
        "data.val_fraction=0.5",
    )  # fmt: skip
    assert index["dtype"] == "uint32" and open_split(out, "train")[0].dtype == np.uint32
    assert split_tokens(out, "train")[:4].tolist() == [97, 256 + 69_999, 98, 256 + 3]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_memory_stays_bounded_on_a_corpus_six_times_larger(tmp_path: Path, kind: str):
    """Python's peak allocation while preparing 6 MB is within 1 MB of preparing 1 MB: the corpus is
    streamed (a file read whole, or its tokens kept, would add at least 5 MB), BPE training included."""
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghij"), size=n)) for n in rng.integers(2, 9, size=2000)]
    lines = [" ".join(rng.choice(words, size=180)) + "\n" for _ in range(500)]
    peaks = []
    for mb in (1, 6):
        folder = tmp_path / f"c{mb}"
        folder.mkdir()
        for name in ("a.txt", "b.txt"):
            with open(folder / name, "w") as f:
                for i in range(mb * 2**19 // 1000):
                    f.write(lines[i % len(lines)])
        tracemalloc.start()
        corpus = (f"data.path={folder}", "data.val_fraction=0.5", f"tokenizer={kind}", "tokenizer.vocab_size=400")
        shards_of(tmp_path, f"out{mb}", *corpus)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    print(f"{kind}: peak Python allocation {peaks[0] / 2**20:.1f} MB (1 MB) vs {peaks[1] / 2**20:.1f} MB (6 MB)")
    assert peaks[1] - peaks[0] < 2**20, peaks


def test_a_failed_prepare_leaves_nothing_and_an_existing_one_is_kept(tmp_path: Path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"text": "fine"}\n' * 50 + '{"body": "no text field"}\n')
    with pytest.raises(ConfigError, match=r"a.jsonl:51 is not a JSON object with a 'text' field"):
        shards_of(tmp_path, "out", f"data.path={tmp_path}/in")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # no shards, no temporary directory
    (tmp_path / "in" / "a.jsonl").write_text('{"text": "fine"}\n' * 50 + '{"text": 7}\n')
    with pytest.raises(ConfigError, match=r"a.jsonl:51: data.text_field='text' holds a int, not text"):
        shards_of(tmp_path, "out", f"data.path={tmp_path}/in")
    (tmp_path / "in" / "a.jsonl").write_text('{"text": "one document only"}\n')
    with pytest.raises(ConfigError, match=r"split is empty \(1 documents, data.val_fraction=0.1\); add text"):
        shards_of(tmp_path, "out", f"data.path={tmp_path}/in", "data.val_fraction=0.1")
    (tmp_path / "in" / "a.jsonl").write_text('{"text": "fine"}\n' * 50)
    for bad, says in (
        ("data.val_fraction=1", r"data.val_fraction=1.0: must be in \(0, 1\)"),
        ("tokenizer.vocab_size=200", "tokenizer.vocab_size=200: a BPE needs more than the 256 bytes"),
    ):
        with pytest.raises(ConfigError, match=says):
            shards_of(tmp_path, "out", f"data.path={tmp_path}/in", "tokenizer=bpe", bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]
    (tmp_path / "out").mkdir()
    with pytest.raises(ConfigError, match="already exists"):
        shards_of(tmp_path, "out", f"data.path={tmp_path}/in")


def run_prepare(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "jobs" / "prepare_data.py"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)


def test_the_job_prints_the_train_command_and_refuses_bad_input_in_one_line(tmp_path: Path, corpus: Path):
    out = tmp_path / "out"
    done = run_prepare(f"data.path={corpus}", "tokenizer=bpe", f"tokenizer.vocab_size={VOCAB}", f"data.shards={out}")
    assert done.returncode == 0, done.stderr
    assert "tokenizing" in done.stdout and "100%" in done.stdout  # the progress line
    command = done.stdout.strip().splitlines()[-1].split(" jobs/train.py ")[1].split()
    assert command == [f"data.shards={out}", f"model.vocab_size={VOCAB}"]  # the shards' own tokenizer
    validate(compose(["trainer.seq_len=32", *command]))  # the printed command passes the checks
    for args, message in (
        ([f"data.path={corpus}"], "data.shards is not set"),
        ([f"data.path={corpus}", f"data.shards={out}"], "already exists"),
        (["tokenizer=nope", f"data.shards={tmp_path}/x"], "unknown tokenizer 'nope'"),
        ([f"data.path={tmp_path}/none", f"data.shards={tmp_path}/x"], "matches no files"),
    ):
        failed = run_prepare(*args)
        assert failed.returncode == 2 and failed.stderr.count("\n") == 1 and message in failed.stderr, failed.stderr


def test_bad_shards_are_refused_in_one_line_before_any_worker(tmp_path: Path, bpe_shards: Path, corpus: Path):
    good = [f"data.shards={bpe_shards}", "tokenizer=bpe", f"model.vocab_size={VOCAB}"]
    validate(make_config(tmp_path, *good))
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in bpe_shards.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    with open(broken / "train_000001.bin", "r+b") as f:
        f.truncate(10)
    bytes_shards, _ = shards_of(tmp_path, "bytes", f"data.path={corpus}")
    other, _ = shards_of(tmp_path, "other", f"data.path={corpus}/sub", "tokenizer=bpe", "tokenizer.vocab_size=300")
    (tmp_path / "empty").mkdir()
    swapped, lost = tmp_path / "swapped", tmp_path / "lost"  # whole tokens, another tokenizer.json or none
    shutil.copytree(bpe_shards, swapped)
    shutil.copy(other / "tokenizer.json", swapped / "tokenizer.json")
    shutil.copytree(bpe_shards, lost)
    (lost / "tokenizer.json").unlink()
    cases = (
        *(
            ([f"data.shards={d}", "tokenizer=bpe", "model.vocab_size=512"], "not the one its tokens were made with")
            for d in (swapped, lost)
        ),
        ([f"data.shards={tmp_path}/missing"], "does not exist"),
        ([f"data.shards={tmp_path}/empty", "tokenizer=bpe"], "not prepared"),
        ([f"data.shards={broken}", "tokenizer=bpe"], "is corrupt"),
        ([*good, "model.vocab_size=300"], f"set model.vocab_size={VOCAB}"),
        ([*good, f"tokenizer.path={other}"], "another tokenizer than tokenizer.path"),
        (
            [f"data.shards={bpe_shards}", f"model.vocab_size={VOCAB}", "tokenizer=bytes"],
            "tokenizer=bpe, this config names tokenizer=bytes",
        ),
        ([f"data.shards={bytes_shards}", "tokenizer=bpe"], "tokenizer=bytes, this config names tokenizer=bpe"),
        (["tokenizer=bpe", f"model.vocab_size={VOCAB}"], "run distrain prepare-data"),
        ([*good, "trainer.seq_len=100000"], r"no training shard holds more than trainer.seq_len\+1"),
    )
    for overrides, message in cases:
        cfg = make_config(tmp_path, "run.name=refused", *overrides)
        with pytest.raises(ConfigError, match=message) as e:
            train(cfg)
        assert "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "refused").exists()
    (broken / "index.json").write_text("{")
    with pytest.raises(ConfigError, match="is corrupt"):
        validate(make_config(tmp_path, f"data.shards={broken}", "tokenizer=bpe"))


def test_a_resume_needs_the_same_shards():
    saved = {"run": {"name": "r"}, "data": {"shards": "/a"}}
    check_same_shards(saved, {"run": {"name": "r"}, "data": {"shards": "/b/../a/"}})  # the same folder
    for other in ("/b", None):
        with pytest.raises(ConfigError, match=f"data.shards='/a', this config has {other!r}"):
            check_same_shards(saved, {"run": {"name": "r"}, "data": {"shards": other}})
    check_same_shards({"run": {"name": "r"}, "data": {}}, {"run": {"name": "r"}, "data": {"shards": None}})


def bpe_config(tmp_path: Path, shards: Path, *overrides: str):
    return make_config(
        tmp_path, f"data.shards={shards}", "tokenizer=bpe", f"model.vocab_size={VOCAB}", "optim.decay_steps=20",
        *overrides,
    )  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("ray_cluster")
def test_bpe_shards_train_the_same_on_one_and_two_workers(tmp_path: Path, bpe_shards: Path):
    """The global batch of step k comes from (seed, k) alone: 2 workers and 1 agree within 1e-5."""
    runs = {}
    for workers in (2, 1):
        runs[workers] = bpe_config(tmp_path, bpe_shards, f"run.name=w{workers}", f"cluster.num_workers={workers}",
                                   "trainer.max_steps=20", "trainer.eval_interval=10")  # fmt: skip
        train(runs[workers])
    worst = {}
    for key in ("loss", "grad_norm"):
        want, got = logged(runs[1], key), logged(runs[2], key)
        assert sorted(want) == sorted(got) == list(range(1, 21))
        worst[key] = max(abs(got[step] - want[step]) / max(1, abs(want[step])) for step in want)
    assert logged(runs[1])[20] < logged(runs[1])[1] - 0.5  # it learns
    one, two = final_weights(runs[1]), final_weights(runs[2])
    assert one["output.weight"].shape[0] == VOCAB
    worst["weights"] = max((two[name] - tensor).abs().max().item() for name, tensor in one.items())
    print(f"1 vs 2 workers on BPE shards, largest differences: {worst}")
    assert max(worst.values()) <= 1e-5, worst


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("ray_cluster")
def test_a_resume_on_shards_is_exact(tmp_path: Path, bpe_shards: Path):
    common = ["cluster.num_workers=2", "trainer.max_steps=20"]
    straight = bpe_config(tmp_path, bpe_shards, "run.name=straight", *common)
    train(straight)
    first = bpe_config(tmp_path, bpe_shards, "run.name=resumed", *common, "trainer.max_steps=10",
                       "checkpoint.async=false")  # fmt: skip
    assert train(first)["final_step"] == 10
    elsewhere = tmp_path / "copy"  # the same tokens in another folder: a resume takes only the run's own shards
    shutil.copytree(bpe_shards, elsewhere)
    with pytest.raises(ConfigError, match="resume with the same data.shards"):
        train(bpe_config(tmp_path, elsewhere, "run.name=resumed", *common))
    second = bpe_config(tmp_path, bpe_shards, "run.name=resumed", *common)
    assert train(second)["resumed_from"].endswith("step_00000010")
    assert logged(second) == logged(straight)
    a, b = final_weights(straight), final_weights(second)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_shards_of_another_format_or_a_run_without_a_checkpoint_are_refused_in_one_line(tmp_path: Path):
    """An index written by another version of the format (prepare again), and export/generate on a run that
    has not committed a checkpoint yet."""
    from distrain.data.shards import FORMAT, SPLITS, parse_index
    from distrain.driver.trained import checkpoint_path

    index = {"format": FORMAT + 1, "tokenizer": {"kind": "bytes", "fingerprint": "x", "vocab_size": 256}}
    index |= {"dtype": "uint8", "splits": {s: {"shards": []} for s in SPLITS}}
    with pytest.raises(ConfigError, match=rf"has format {FORMAT + 1}, this distrain reads {FORMAT}; prepare it again"):
        parse_index(json.dumps(index), "data.shards='x'", {})
    (tmp_path / "fresh").mkdir()
    with pytest.raises(ConfigError, match="run fresh has no committed checkpoint yet: train it"):
        checkpoint_path(tmp_path / "fresh")
