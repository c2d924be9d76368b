"""The benches cannot lie: a side that did not do its work stops the bench, naming it, instead of being timed
(a baseline that failed at once made gpujobs look 0.36x of it). Real processes; the timings themselves are
the benches' business, never a test's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_bench_sweep_without_hydras_submitit_launcher_exits_naming_it(tmp_path: Path) -> None:
    """hydra-submitit-launcher hidden as if not installed (a package of that name first on the path that cannot
    be imported): the bench says so before timing anything, exit 1."""
    hidden = tmp_path / "hydra_plugins" / "hydra_submitit_launcher"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text('raise ImportError("No module named hydra_submitit_launcher")\n')
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_sweep.py"), "--points", "2"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout + proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("bench_sweep: (b) Hydra's submitit launcher (hydra-submitit-launcher) failed: it is not "
                           "installed"), line


def test_a_side_whose_command_fails_stops_the_bench_naming_it(tmp_path: Path) -> None:
    """`sides.ran`, as every bench runs a side's command: its failure is one line naming the side and the
    command's last words, exit 1."""
    script = tmp_path / "bench_probe.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(REPO / 'bench')!r})\nfrom sides import ran\n"
                      "ran('(b) the baseline', [sys.executable, '-c', 'raise SystemExit(\"no launcher here\")'])\n"
                      "print('timed')\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "timed" not in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (f"bench_probe: (b) the baseline failed: {sys.executable} -c raise "
                                   "SystemExit(\"no launcher here\") ... exited 1: no launcher here"), proc.stderr
