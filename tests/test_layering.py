"""The sides stay apart: the job side never imports the submit side, and the run-dir package is torch-free."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (functions included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_the_job_side_never_imports_the_submit_side() -> None:
    offenders = {
        str(path.relative_to(REPO)): sorted(m for m in imported_modules(path) if m.startswith("gpujobs.launch"))
        for folder in ("gpujobs/run", "gpujobs/rundir")
        for path in (REPO / folder).glob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}
    assert len(offenders) > 10  # the walk saw the job side's modules


def test_the_run_dir_package_loads_without_torch() -> None:
    code = (
        "import sys, gpujobs.rundir, gpujobs.rundir.files, gpujobs.rundir.attempts, gpujobs.rundir.lease, "
        "gpujobs.rundir.records, gpujobs.rundir.resume, gpujobs.rundir.trackers; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
