"""A trained run as a Hugging Face model directory: python jobs/export.py run.name=NAME out=DIR

From a checkout, `python jobs/export.py ...` is the installed `distrain export ...`: both call
distrain/commands/export.py, whose docstring says how (and `--help`)."""

import sys

from distrain.commands.export import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
