"""The run directory's files: checkpoints, the run record (metrics, summary, W&B), atomic writes and locks, and
the NVMe tier's direct I/O."""
