"""Text → tokens → batches. `tokenizer`: bytes or a BPE; `corpus`: the byte corpus read into memory (the
default run); `documents`, `prepare`, `shards`: text streamed into token shards on disk; `loader`:
deterministic, resumable batches sharded over ranks, from either; `checks`: the data's rules, before workers."""
