"""Optimizer and learning-rate schedule from `OptimConfig`."""

from __future__ import annotations

import math

import torch

from gpujobs.config.load import OptimConfig
from gpujobs.rank.step_settings import step_setting


def build_optimizer(params: list[torch.nn.Parameter], cfg: OptimConfig, cuda: bool = False) -> torch.optim.Optimizer:
    """The optimizer `cfg.name` names, with its learning rate and weight decay; Adam's and AdamW's fused kernel
    on `cuda` ranks (`step_settings`), torch's default kernel on the CPU."""
    fused = True if cuda and step_setting("fused_adam") else None  # None: torch's own choice (foreach)
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def lr_factor(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Multiplier of the peak learning rate at `step`: linear warm-up, then the schedule."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    decay = 1.0 - progress if cfg.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR following `lr_factor`; its state is saved with the checkpoint."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, max_steps))


def schedule_is_flat(cfg: OptimConfig) -> bool:
    """Whether the learning rate never moves (constant, no warm-up): stepping its scheduler then changes
    nothing but its counter, and the train step can leave it out."""
    return cfg.schedule == "constant" and cfg.warmup_steps == 0
