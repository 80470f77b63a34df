"""One rank's training: optimizer and LR schedule, metrics, and the step loop."""
