"""Models: the contract every strategy relies on (contract.py), the registry that builds `model._target_`
(registry.py), the shipped families (llama.py, gpt2.py, sharing common.py), each described by a
torch-free record (families/: sizes, FLOPs, plans, Hugging Face mapping) that size.py, hf.py and the
driver's validation read."""
