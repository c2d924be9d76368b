"""gpujobs: one Hydra config → a preemption-safe multi-GPU PyTorch DDP job, on Slurm or on this machine."""

__version__ = "0.1.0"
