"""Shared helpers: compose the real config tree, and run `python -m gpujobs.submit` for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir

from gpujobs.config import JobConfig, load_config

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"


def compose_job(*overrides: str) -> JobConfig:
    """The validated config `python -m gpujobs.submit <overrides>` would run."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return load_config(cfg)


def submit(
    run_dir: Path, *overrides: str, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a subprocess with its run dir at `run_dir`."""
    cmd = [sys.executable, "-m", "gpujobs.submit", f"hydra.run.dir={run_dir}", *overrides]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(cmd, cwd=run_dir.parent, capture_output=True, text=True, timeout=timeout, env=full_env)


def read_result(run_dir: Path) -> dict[str, Any]:
    """The run's result.json."""
    return json.loads((run_dir / "result.json").read_text())


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of the run's metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A fresh run directory path (not created: the CLI creates it)."""
    return tmp_path / "run"
