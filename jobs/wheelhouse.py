"""A folder of wheels that installs distrain with no package index: python jobs/wheelhouse.py [...]

From a checkout, `python jobs/wheelhouse.py ...` is the installed `distrain wheelhouse ...`: both call
distrain/commands/wheelhouse.py, whose docstring says how (and `--help`)."""

import sys

from distrain.commands.wheelhouse import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
