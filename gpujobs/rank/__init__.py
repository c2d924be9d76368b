"""Job side: distributed setup, trainer, checkpoints and metrics (imports torch)."""
