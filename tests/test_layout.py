"""The house's rules that a reader relies on: small modules and functions, the cluster asked about only
inside `gpujobs/backends/`, Slurm's commands run by one runner. (The layers themselves, and which of
them may import torch, are import-linter's contracts in pyproject.toml: `lint-imports` in CI.)"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "gpujobs"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
SLURM_COMMANDS = ("sbatch", "squeue", "sacct", "scontrol", "scancel", "sinfo", "sacctmgr", "srun", "salloc")


def modules() -> list[Path]:
    found = sorted(PACKAGE.rglob("*.py"))
    assert len(found) > 60  # the walk sees every package, at any depth
    return found


def test_no_module_is_over_400_lines() -> None:
    long = {str(p.relative_to(REPO)): n for p in modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_no_function_is_over_60_lines() -> None:
    long = {}
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(REPO)}:{node.name}"] = lines
    assert long == {}


def test_only_the_backends_ask_which_cluster_a_job_runs_on() -> None:
    asks = re.compile(r"""cluster\.name\s*(==|!=|in\b|not in\b)|[=!]=\s*["'](slurm|local|debug|kubernetes)["']""")
    outside = [f"{p.relative_to(REPO)}:{i}" for p in modules() if "backends" not in p.relative_to(PACKAGE).parts
               for i, line in enumerate(p.read_text().splitlines(), 1) if asks.search(line)]
    assert outside == []


def test_slurm_commands_run_only_through_the_one_runner() -> None:
    """A Slurm command is named (the first item of an argument list) only inside the Slurm backend, and
    there only `commands.py` runs processes: one runner, one error type."""
    slurm = PACKAGE / "backends" / "slurm"
    named, runners = [], []
    for path in modules():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.List) and node.elts and isinstance(node.elts[0], ast.Constant) \
                    and node.elts[0].value in SLURM_COMMANDS and slurm not in path.parents:
                named.append(f"{path.relative_to(REPO)}:{node.lineno}")
            imports_subprocess = (isinstance(node, ast.Import) and any(a.name == "subprocess" for a in node.names)) \
                or (isinstance(node, ast.ImportFrom) and node.module == "subprocess")
            if imports_subprocess and slurm in path.parents and path.name != "commands.py":
                runners.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert named == []
    assert runners == []


def test_the_layers_hold() -> None:
    """import-linter's contracts (pyproject.toml): every import points down a layer; nothing below the
    rank layer imports torch; the submit side never imports the rank side."""
    proc = subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--no-cache"], capture_output=True,
                          text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout and "kept" in proc.stdout
