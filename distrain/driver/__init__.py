"""The user's process: from the command line to a supervised run (torch-free until the workers), and the
one-process tools jobs/export.py and jobs/generate.py start from (docs/architecture.md)."""
