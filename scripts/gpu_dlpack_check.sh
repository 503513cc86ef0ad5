#!/usr/bin/env bash
# bridge_mr.dlpack on a CUDA machine, from the repository root, without installing bridge_mr:
# versions, the dlpack tests (CUDA tests included), and the quick benchmark on CUDA and CPU.
# Needs python3 with torch (CUDA), jax with its CUDA plugin, pytest and hypothesis. Logs go to
# "$OUT" when set (else ./gpu_dlpack_logs). Exit status: that of pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${OUT:-$PWD/gpu_dlpack_logs}
mkdir -p "$LOGS"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# CPU first: JAX's default backend stays the CPU the non-CUDA tests expect; CUDA tests ask for
# GPUs explicitly.
export JAX_PLATFORMS=cpu,cuda
# torch and JAX share the GPU: JAX must not reserve most of its memory up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

python3 - <<'PY' 2>&1 | tee "$LOGS/versions.txt"
import platform, torch, jax, jaxlib
print("python", platform.python_version(), "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| jax", jax.__version__, "jaxlib", jaxlib.__version__)
print("torch cuda devices:", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
print("jax devices:", jax.devices("cuda"), "| default backend:", jax.default_backend())
PY

timeout 150 python3 -m pytest tests/dlpack -q -p no:cacheprovider -rs 2>&1 | tee "$LOGS/pytest.txt"
status=${PIPESTATUS[0]}

for device in cuda cpu; do
  timeout 30 python3 -m benchmarks.studies.bench_dlpack --quick --device "$device" 2>&1 \
    | tee "$LOGS/bench_$device.txt"
done
exit "$status"
