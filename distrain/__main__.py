"""`python -m distrain COMMAND ...` is `distrain COMMAND ...` (distrain/commands/__init__.py)."""

from distrain.commands import script

if __name__ == "__main__":  # not when a walk over the package imports every module
    script()
