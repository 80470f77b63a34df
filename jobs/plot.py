"""A picture of one run or several: python jobs/plot.py run.name=NAME[,NAME...]

From a checkout, `python jobs/plot.py ...` is the installed `distrain plot ...`: both call
distrain/commands/plot.py, whose docstring says how (and `--help`)."""

import sys

from distrain.commands.plot import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
