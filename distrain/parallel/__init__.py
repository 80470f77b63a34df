"""torch.distributed only (no Ray): process group, device mesh, and the parallelism strategies."""
