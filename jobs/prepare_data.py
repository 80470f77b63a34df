"""Text → token shards for training: python jobs/prepare_data.py data.path=... data.shards=OUT

From a checkout, `python jobs/prepare_data.py ...` is the installed `distrain prepare-data ...`: both call
distrain/commands/prepare_data.py, whose docstring says how (and `--help`)."""

import sys

from distrain.commands.prepare_data import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
