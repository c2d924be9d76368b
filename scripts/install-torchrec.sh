#!/usr/bin/env bash
# Install TorchRec for parallel=torchrec, as torch is installed: the build for this machine first.
#   bash scripts/install-torchrec.sh cpu    # FBGEMM's CPU build (fbgemm-gpu-cpu): gloo ranks, tests, `gpujobs plan`
#   bash scripts/install-torchrec.sh cuda   # FBGEMM's CUDA build (fbgemm-gpu), which must match the CUDA of torch
# 1. FBGEMM's build for the machine; 2. torchrec itself with --no-deps (its own requirement pins the CUDA
# build of fbgemm-gpu, which would replace the CPU one and pull CUDA wheels); 3. the extra `gpujobs[torchrec]`
# (torchrec's other requirements), from this checkout where gpujobs is installed from it (or not yet at all).
# Install torch first (README): nothing here may pull another one. TORCHREC_VERSION picks another release
# (FBGEMM and TorchRec are released together, under one version number).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
version="${TORCHREC_VERSION:-1.8.0}"
case "${1:-}" in
  cpu) fbgemm=fbgemm-gpu-cpu ;;
  cuda) fbgemm=fbgemm-gpu ;;
  *) echo "usage: $0 cpu|cuda (FBGEMM's build: cpu for CPU ranks and planning, cuda for GPU ranks)" >&2; exit 2 ;;
esac
if ! python -c 'import torch' 2>/dev/null; then
  echo "$0: install torch first (the README's install line): FBGEMM and TorchRec are built against it" >&2
  exit 2
fi
pip install -q "$fbgemm==$version"
pip install -q --no-deps "torchrec==$version"
installed="$(python -c 'import gpujobs, os; print(os.path.dirname(os.path.dirname(os.path.abspath(gpujobs.__file__))))' 2>/dev/null || true)"
if [ -z "$installed" ] || [ "$installed" = "$repo" ]; then
  pip install -q -e "$repo[torchrec]"
else
  echo "$0: gpujobs is installed from $installed: add its extra there (pip install 'gpujobs[torchrec]')" >&2
fi
python -c 'import torchrec, fbgemm_gpu; print(f"torchrec {torchrec.__version__} with fbgemm-gpu {fbgemm_gpu.__version__}")'
