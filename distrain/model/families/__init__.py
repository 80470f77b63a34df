"""The shipped model families, one record each (record.py): the one list the driver, the size
formulas and the Hugging Face interop read. Adding a family: its model module, its record module
here, one entry in FAMILIES."""

from __future__ import annotations

from distrain.model.families import gpt2, llama, moe
from distrain.model.families.family import Family

FAMILIES: dict[str, Family] = {f.target: f for f in (llama.FAMILY, gpt2.FAMILY, moe.FAMILY)}  # by model._target_


def shipped(target: str) -> Family | None:
    """The shipped family `target` (a model._target_) builds; None for a user's own model."""
    return FAMILIES.get(target)
