"""The training loop: the schedule executor, optimizer and precision, checkpoints, the
launch of a bundle's rank and the single-process reference."""
