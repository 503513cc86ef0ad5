#!/usr/bin/env bash
# Everything bridge_mr checks on a CUDA machine, in one short run from the repository root
# (no install: PYTHONPATH): the DLPack checks and benchmark, then the torch frontend on CUDA,
# then from_torch on CUDA (torchax: pip-installed from ./.whl when that folder holds its wheel,
# the way the device machine gets packages it lacks). Logs go to "$OUT" when set (else ./gpu_logs).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/gpu_logs}
mkdir -p "$OUT"
bash scripts/gpu_dlpack_check.sh
dlpack_status=$?
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export JAX_PLATFORMS=cpu,cuda XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 120 python3 -m pytest tests/torch_api/test_cuda.py -q -p no:cacheprovider -rs 2>&1 \
  | tee "$OUT/pytest_torch_api_cuda.txt"
torch_status=${PIPESTATUS[0]}
if compgen -G ".whl/torchax-*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/torchax-*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
timeout 240 python3 -m pytest tests/torch_fn/test_cuda.py -q -p no:cacheprovider -rs 2>&1 \
  | tee "$OUT/pytest_torch_fn_cuda.txt"
from_torch_status=${PIPESTATUS[0]}
echo "dlpack: $dlpack_status, torch_api cuda: $torch_status, from_torch cuda: $from_torch_status"
exit $(( dlpack_status || torch_status || from_torch_status ))
