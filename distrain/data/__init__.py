"""Corpus → byte tokens (`corpus`) → deterministic, resumable batches sharded over ranks (`loader`)."""
