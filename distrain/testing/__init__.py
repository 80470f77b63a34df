"""What the tests and the benchmarks start and must end, importable from both without `sys.path` edits: a
multi-host test bed of network namespaces (hosts.py), a real S3-compatible store (seaweed.py), and commands,
bounded calls and gloo ranks (processes.py). Nothing in distrain imports it: it serves the repository's
tests/ and jobs/, and its commands run from the repository's root."""
