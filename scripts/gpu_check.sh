#!/usr/bin/env bash
# Everything bridge_mr checks on a CUDA machine, in one short run from the repository root
# (no install: PYTHONPATH): the DLPack checks and benchmark, then the torch frontend on CUDA,
# then from_torch on CUDA (torchax: pip-installed from ./.whl when that folder holds its wheel,
# the way the device machine gets packages it lacks), then issue 31's benchmark rows on CUDA.
# Logs go to "$OUT" when set (else ./gpu_logs). At most ~8 minutes on an H200.
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
# Issue 31's GPU rows (python -m benchmarks --cases accelerator --device cuda), one command per
# row so that a row over its time limit loses only itself; 2 later rounds each, ~4 minutes in
# all. Each row's results.json / results.md go to "$OUT/accelerator/<row>/", its log beside.
# bridge_mr:per_client is left out here (time); the case's default set includes it.
bench_status=0
bench_row() {  # bench_row NAME SECONDS MODEL CLIENTS ALTERNATIVE...
  local name=$1 seconds=$2 model=$3 clients=$4
  shift 4
  mkdir -p "$OUT/accelerator/$name"
  timeout -k 10 "$seconds" python3 -m benchmarks --cases accelerator --device cuda --reps 2 \
    --no-plots --models "$model" --clients "$clients" --alternatives "$@" \
    --out "$OUT/accelerator/$name" > "$OUT/accelerator/$name/log.txt" 2>&1
  local status=$?
  echo "accelerator $name: exit $status (limit ${seconds}s)"
  [ "$status" -eq 0 ] || bench_status=1
}
bench_row tiny 30 tiny 4 torch_loop bridge_mr pure_jax
bench_row cnn_c50 55 cnn 50 torch_loop torch_vmap bridge_mr bridge_mr:vmap bridge_mr:chunks:16 pure_jax
bench_row cnn_c500 60 cnn 500 torch_loop torch_vmap bridge_mr bridge_mr:vmap pure_jax
bench_row gpt2_c16 45 gpt2_128 16 torch_loop torch_vmap bridge_mr bridge_mr:vmap pure_jax
bench_row gpt2_c128 50 gpt2_128 128 torch_loop torch_vmap bridge_mr bridge_mr:vmap pure_jax
# The cost of one call on CUDA (issue 31, item 4: the bridge's own share, above torch's floor
# with the pure JAX call inside it), its tables in "$OUT/overhead/".
mkdir -p "$OUT/overhead"
timeout -k 10 60 python3 -m benchmarks --cases overhead --device cuda --no-plots --memory none \
  --out "$OUT/overhead" > "$OUT/overhead/log.txt" 2>&1
overhead_status=$?
echo "overhead (cuda): exit $overhead_status (limit 60s)"
echo "dlpack: $dlpack_status, torch_api cuda: $torch_status, from_torch cuda: $from_torch_status," \
  "accelerator rows: $bench_status, overhead: $overhead_status"
exit $(( dlpack_status || torch_status || from_torch_status || bench_status || overhead_status ))
