"""A Ray cluster of one machine, on loopback, for `ray job submit`: python jobs/cluster.py start | stop

From a checkout, `python jobs/cluster.py ...` is the installed `distrain cluster ...`: both call
distrain/commands/cluster.py, whose docstring says how (and `--help`)."""

import sys

from distrain.commands.cluster import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
