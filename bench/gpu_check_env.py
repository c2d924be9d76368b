"""Can this python run the GPU check? Run by `bench/gpu_check.sh` before anything else (stdlib only):

    python bench/gpu_check_env.py [--wheelhouse DIR --target TMP]

It prints torch's, CUDA's and NCCL's versions, then tries every module the check's driver and its children
import (`MODULES`, then the checkout's own entry points, `ENTRY_POINTS`), one line for each that is missing.
With `--wheelhouse`, the missing ones are installed from DIR's wheels into TMP (`pip install --no-index
--no-deps --target`: nothing else on the node is touched; gpu_check.sh puts TMP on PYTHONPATH and removes it
at the end), round after round, as a module installed may reveal another it needs. Exit 0: all importable;
2: something is missing (each named, with the pip name to put in DIR).
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

import checkout  # noqa: F401  (the checkout on the path: its entry points are tried too)

#: Every third-party module the driver, `gpujobs.submit`, the ranks, the CUDA checks and the report import,
#: each tried on its own so that all the missing are named at once (torch is the node's own: never installed).
MODULES = (
    "torch", "numpy", "yaml", "jinja2", "pynvml", "pyarrow", "numba", "rich", "prometheus_client", "matplotlib",
    "packaging", "hydra", "omegaconf", "antlr4", "submitit", "cloudpickle", "typing_extensions",
)
#: The checkout's modules the check runs: any module they import that `MODULES` misses is found here.
ENTRY_POINTS = ("gpujobs.submit", "gpujobs.cli.main", "gpujobs.rank.train", "gpujobs.cli.report", "jobs.rec.task")
#: A module's distribution where the names differ (pip installs distributions, Python imports modules).
DISTRIBUTIONS = {
    "yaml": "pyyaml", "pynvml": "nvidia-ml-py", "hydra": "hydra-core", "antlr4": "antlr4-python3-runtime",
    "prometheus_client": "prometheus-client", "typing_extensions": "typing-extensions", "PIL": "pillow",
    "dateutil": "python-dateutil", "markdown_it": "markdown-it-py", "google": "protobuf",
}
#: Rounds of installing: hydra-core's wheel installed shows that omegaconf is missing, omegaconf's antlr4.
ROUNDS = 6


def distribution(module: str) -> str:
    """The pip name of top-level `module`."""
    return DISTRIBUTIONS.get(module, module.replace("_", "-"))


def versions() -> str:
    """torch's, CUDA's and NCCL's versions, and the GPUs torch sees (one line; torch is imported)."""
    import torch

    cuda = torch.version.cuda or "none (a CPU build of torch)"
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "none (no CUDA)"
    except (AttributeError, RuntimeError) as err:  # a build without NCCL
        nccl = f"none ({err})"
    return f"torch {torch.__version__}, CUDA {cuda}, NCCL {nccl}, {torch.cuda.device_count()} GPU(s) visible to torch"


def missing() -> dict[str, str]:
    """Each module that cannot be imported -> why (one line)."""
    importlib.invalidate_caches()  # a target dir filled since the last round
    found: dict[str, str] = {}
    for name in (*MODULES, *ENTRY_POINTS):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as err:
            top = (err.name or name).split(".")[0]
            wanted = "" if top == name else f" (imported by {name})"
            found.setdefault(top, f"{top}{wanted}: pip name {distribution(top)}")
        except Exception as err:  # a module that is there but broken: no wheel mends it
            found.setdefault(name, f"{name}: present but fails to import: {type(err).__name__}: {err}"[:300])
    return found


def install(modules: list[str], wheelhouse: Path, target: Path) -> None:
    """The distributions of `modules` from `wheelhouse` into `target`, their dependencies left to later rounds."""
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index",
           "--no-deps", "--find-links", str(wheelhouse), "--target", str(target),
           *sorted({distribution(m) for m in modules})]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        raise SystemExit(f"gpu_check: pip could not install {', '.join(sorted(modules))} from {wheelhouse}: "
                         f"{lines[-1] if lines else 'exit ' + str(done.returncode)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheelhouse", type=Path, help="a folder of wheels for the modules this python lacks")
    parser.add_argument("--target", type=Path, help="where to install them (on PYTHONPATH already)")
    args = parser.parse_args()
    try:
        print(f"gpu_check: {versions()}", flush=True)
    except ModuleNotFoundError:
        print("gpu_check: torch is missing: run with the node's PyTorch (PYTHON=/path/to/python)", file=sys.stderr)
        return 2
    absent = missing()
    for _ in range(ROUNDS):
        if not absent or args.wheelhouse is None or args.target is None:
            break
        installable = [m for m, why in absent.items() if "fails to import" not in why and m != "torch"]
        if not installable:
            break
        print(f"gpu_check: installing {', '.join(sorted(map(distribution, installable)))} from {args.wheelhouse}",
              flush=True)
        if str(args.target) not in sys.path:
            sys.path.insert(0, str(args.target))
        install(installable, args.wheelhouse, args.target)
        now = missing()
        if set(now) >= set(absent):  # installed, yet still missing: no round will do better
            absent = now
            break
        absent = now
    for why in absent.values():
        print(f"gpu_check: missing {why}", file=sys.stderr)
    if absent:
        hint = ("put their wheels in the wheelhouse (docs/guides/benchmarks.md)" if args.wheelhouse else
                "rerun with --wheelhouse DIR holding their wheels (docs/guides/benchmarks.md), or install them")
        print(f"gpu_check: {len(absent)} module(s) missing: {hint}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
