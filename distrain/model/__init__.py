"""The transformer family (llama.py: the model and its tensor-parallel plan) and its size from the
config alone (size.py: parameters and FLOPs per token, importable without torch)."""
