"""How text becomes tokens: bytes (ids are the byte values; nothing to install or train) or a byte-level
BPE from Hugging Face `tokenizers`, trained on a corpus or loaded from a tokenizer.json. Both save files
`transformers.AutoTokenizer.from_pretrained` loads and encodes with identically."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from distrain.config import ConfigError
from distrain.data.shards import PREPARE

if TYPE_CHECKING:
    from distrain.config import TrainConfig

EOS = "<|endoftext|>"  # a trained BPE's one special token: prepare_data.py ends each document with it
# Names an imported model's end-of-text token goes by, when no tokenizer_config.json says which.
EOS_NAMES = (EOS, "</s>", "<|end_of_text|>", "<eos>")
HF_HINT = 'pip install -e ".[hf]"'


@functools.cache
def byte_chars() -> tuple[str, ...]:
    """The printable character standing for each byte in a byte-level vocabulary (the convention GPT-2's
    tokenizer.json uses): printable Latin-1 bytes stand for themselves, the others for 256, 257, ..."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return tuple(chr(b) if b in printable else chr(next(extra)) for b in range(256))


def _byte_level(use_regex: bool) -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": use_regex}


@functools.cache
def byte_tokenizer_json() -> str:
    """The byte tokenizer as a tokenizer.json: a BPE without merges over the 256 byte characters, id = byte."""
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": _byte_level(use_regex=False),
        "post_processor": None,
        "decoder": _byte_level(use_regex=False),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {c: i for i, c in enumerate(byte_chars())},
            "merges": [],
        },
    }
    return json.dumps(doc, ensure_ascii=False, indent=1)


class Tokenizer:
    """What every tokenizer offers: `vocab_size`, `encode`, `decode`, `fingerprint`, `eos_id`, `save`."""

    kind: str  # "bytes" | "bpe"
    vocab_size: int
    eos_id: int | None  # the token ending each document in shards; None: documents simply follow each other

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[Sequence[int]]:
        return [self.encode(t) for t in texts]

    def to_json(self) -> str:
        """The tokenizer.json text."""
        raise NotImplementedError

    @functools.cached_property
    def fingerprint(self) -> str:
        """Identifies the vocabulary, merges and pre-tokenization: sha256 of the tokenizer.json."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def save(self, directory: str | Path) -> None:
        """tokenizer.json and tokenizer_config.json: what `AutoTokenizer.from_pretrained(directory)` reads."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "tokenizer.json").write_text(self.to_json(), encoding="utf-8")
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
        if self.eos_id is not None:
            config |= {"eos_token": self.token(self.eos_id), "bos_token": self.token(self.eos_id)}
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")

    def token(self, token_id: int) -> str:
        """The vocabulary's string for an id."""
        return byte_chars()[token_id]


class ByteTokenizer(Tokenizer):
    """Today's tokens: the UTF-8 bytes of the text."""

    kind, vocab_size, eos_id = "bytes", 256, None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def encode_batch(self, texts: list[str]) -> list[Sequence[int]]:
        """The bytes as arrays: no Python integer per token."""
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def to_json(self) -> str:
        return byte_tokenizer_json()


class BPETokenizer(Tokenizer):
    """A Hugging Face `tokenizers.Tokenizer` (byte-level BPE, or whatever an imported model's tokenizer.json holds)."""

    kind = "bpe"

    def __init__(self, hf: Any, eos_token: str | None = None):
        self.hf = hf
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        names = [eos_token] if eos_token else list(EOS_NAMES)
        self.eos_id = next((hf.token_to_id(n) for n in names if hf.token_to_id(n) is not None), None)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[Sequence[int]]:
        """Many texts at once, on the library's threads."""
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def to_json(self) -> str:
        return self.hf.to_str()

    def token(self, token_id: int) -> str:
        return self.hf.id_to_token(token_id)


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ConfigError(f"tokenizer=bpe needs Hugging Face tokenizers: {HF_HINT}") from None
    return tokenizers


def train_bpe(texts: Iterable[str], vocab_size: int, length: int | None = None) -> BPETokenizer:
    """A byte-level BPE learned from `texts`, consumed as a stream (only word counts are kept), with the
    256 byte characters always in the vocabulary (any text encodes) and EOS as its one special token."""
    tk = _tokenizers()
    if vocab_size < 257:
        raise ConfigError(f"tokenizer.vocab_size={vocab_size}: a BPE needs more than the 256 bytes and its EOS")
    hf = tk.Tokenizer(tk.models.BPE())
    hf.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=list(byte_chars()),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer, length=length)
    return BPETokenizer(hf, EOS)


def load_tokenizer(path: str | Path, key: str = "tokenizer.path") -> Tokenizer:
    """A tokenizer.json, or a directory holding one (an imported Hugging Face model's, or shards'); its
    tokenizer_config.json, when there, names the end-of-text token. The byte tokenizer's own file loads
    back as the byte tokenizer. `key`: the setting that named `path`, for the error."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"{key}={str(path)!r} has no tokenizer.json; give a tokenizer.json or a folder holding one")
    text = file.read_text(encoding="utf-8")
    if text == byte_tokenizer_json():
        return ByteTokenizer()
    tk = _tokenizers()
    try:
        hf = tk.Tokenizer.from_str(text)
    except Exception as e:  # the library says only "expected value at line 1" and the like
        raise ConfigError(f"{str(file)!r} is not a tokenizer.json tokenizers can read: {e}") from None
    config = file.parent / "tokenizer_config.json"
    eos = json.loads(config.read_text()).get("eos_token") if config.is_file() else None
    return BPETokenizer(hf, eos["content"] if isinstance(eos, dict) else eos)


def config_tokenizer(cfg: TrainConfig) -> Tokenizer | None:
    """The tokenizer the config names: bytes, the one at tokenizer.path, or None (a BPE still to train)."""
    t = cfg.tokenizer
    if t.name == "bytes" or (t.name is None and not t.path):
        return ByteTokenizer()
    if t.name not in (None, "bpe"):
        raise ConfigError(f"tokenizer.name={t.name!r}: choose bytes or bpe")
    return load_tokenizer(t.path) if t.path else None


def run_tokenizer(cfg: TrainConfig) -> Tokenizer:
    """What a run trains on: the tokenizer stored with data.shards (fetched into this node's cache from an
    object store), else the one the config names."""
    if cfg.data.shards:
        from distrain.data.remote import local_shards

        return load_tokenizer(local_shards(cfg, tokenizer_only=True), "data.shards")
    tokenizer = config_tokenizer(cfg)
    if tokenizer is None:
        raise ConfigError(f"tokenizer=bpe trains on token shards: run {PREPARE}, then train with data.shards=DIR")
    return tokenizer
