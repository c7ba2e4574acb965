"""Training: data, optimizer, checkpoints, the loop."""
