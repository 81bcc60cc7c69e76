"""Training: generated data and the training loop."""
