"""`python -m distrain COMMAND ...` is `distrain COMMAND ...` (distrain/commands/__init__.py)."""

from distrain.commands import script

script()
