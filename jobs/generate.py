"""Sample from a trained run: python jobs/generate.py run.name=NAME prompt="def "

From a checkout, `python jobs/generate.py ...` is the installed `distrain generate ...`: both call
distrain/commands/generate.py, whose docstring says how (and `--help`)."""

import sys

from distrain.commands.generate import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
