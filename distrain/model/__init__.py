"""Models: the contract every strategy relies on (contract.py), the registry that builds `model._target_`
(registry.py), the shipped families (llama.py, gpt2.py, sharing common.py) and their size from the config
alone (size.py, importable without torch)."""
