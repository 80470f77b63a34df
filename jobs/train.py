"""The main entrypoint, locally and under `ray job submit`: python jobs/train.py [Hydra overrides]

Exit status: 0 a completed run (or sweep of completed runs); 2 bad input, refused before anything is
written; 1 a failed run, an embedded Ray cluster that did not start (twice), or a sweep with a point that
did not complete; 128 + the signal for a run stopped by a signal (130 Ctrl-C, 143 SIGTERM, e.g. `ray job
stop`).

From a checkout, `python jobs/train.py ...` is the installed `distrain train ...`: both call
distrain/commands/train.py, whose docstring says how (and `--help`)."""

import sys

from distrain.commands.train import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
