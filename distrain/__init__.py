"""distrain: distributed training on Ray with PyTorch's own parallelism building blocks."""
