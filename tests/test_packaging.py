"""What an installed gpujobs needs: every third-party import declared, and its own files found.

The wheel itself (built, installed into a new venv and run from outside the checkout) is checked by
scripts/wheel-check.sh, which scripts/test.sh runs; here are the fast checks of the same promises.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from conftest import REPO

from gpujobs.config.packaged import config_dir, template_dir

OWN_PACKAGES = {"gpujobs", "jobs", "hydra_plugins"}
#: Extras that only developers install: code under OWN_PACKAGES may not rely on them.
DEV_EXTRAS = {"test", "dev"}
#: Distributions installed by a script, not declared: torchrec's own requirement pins the CUDA build of
#: fbgemm-gpu, so scripts/install-torchrec.sh installs FBGEMM's build for the machine, then torchrec with
#: --no-deps (and the extra `torchrec` brings the rest of what it needs).
BY_SCRIPT = {"torchrec"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_distributions(pyproject: Path) -> set[str]:
    """The distributions a user's `pip install` brings: `dependencies` plus the user-facing extras."""
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project["dependencies"])
    for extra, reqs in project.get("optional-dependencies", {}).items():
        if extra not in DEV_EXTRAS:
            requirements += reqs
    names = (re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req) for req in requirements)
    return {_canonical(match.group(0)) for match in names if match}


def imported_modules(path: Path) -> set[str]:
    """The top-level names of every absolute import in a file, lazy ones inside functions included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def undeclared_imports(files: Iterable[Path], declared: set[str]) -> dict[str, list[str]]:
    """Third-party modules imported by `files` that no declared distribution provides, with their importers."""
    providers = packages_distributions()
    missing: dict[str, list[str]] = {}
    for path in files:
        for module in imported_modules(path) - OWN_PACKAGES - set(sys.stdlib_module_names):
            # A module not installed here maps to nothing; then only a distribution of its own name counts.
            dists = {_canonical(d) for d in providers.get(module, [module])}
            if not dists & declared:
                missing.setdefault(module, []).append(str(path))
    return missing


def test_every_third_party_import_is_declared() -> None:
    files = sorted(p for pkg in OWN_PACKAGES for p in (REPO / pkg).rglob("*.py"))
    assert len(files) > 30, files  # the walk found the packages
    declared = declared_distributions(REPO / "pyproject.toml") | BY_SCRIPT
    assert undeclared_imports(files, declared) == {}, "add these to [project] dependencies in pyproject.toml"


def test_an_undeclared_import_is_caught(tmp_path: Path) -> None:
    module = tmp_path / "mod.py"
    module.write_text("import os\nimport torch.nn\n\ndef f():\n    from yaml import safe_load\n    import jinja2\n")
    declared = {"torch"}
    assert undeclared_imports([module], declared) == {"yaml": [str(module)], "jinja2": [str(module)]}


def test_a_checkout_reads_the_repository_dirs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUJOBS_CONFIG_DIR", raising=False)
    monkeypatch.delenv("GPUJOBS_SBATCH_TEMPLATES", raising=False)
    assert config_dir() == REPO / "conf"
    assert template_dir() == REPO / "sbatch_templates"
    assert (config_dir() / "config.yaml").is_file()


def test_the_sbatch_template_override_is_what_renders(tmp_path: Path) -> None:
    (tmp_path / "job.sbatch.j2").write_text("#!/bin/sh\n# team template\n{{ command }}\n")
    code = (
        "from gpujobs.backends.slurm.sbatch import SbatchRequest, render_sbatch\n"
        "print(render_sbatch(SbatchRequest((), (), 'o', 'e', 'run-the-job', 60)), end='')\n"
    )
    env = {**os.environ, "GPUJOBS_SBATCH_TEMPLATES": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "#!/bin/sh\n# team template\nrun-the-job\n"
