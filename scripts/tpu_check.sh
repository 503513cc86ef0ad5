#!/usr/bin/env bash
# Everything bridge_mr checks on a TPU host (one v5e chip), from the repository root: the TPU leg
# of the tests (BRIDGE_MR_TPU=1 pytest -m tpu, JAX holding the chip; BRIDGE_MR_TPU_TESTS=0 skips
# it), the TorchTPU leg when BRIDGE_MR_TORCH_TPU=1 (pytest -m torch_tpu, TorchTPU holding the
# chip; torch_tpu from the parts scripts/torch_tpu_setup.sh gathers), then the TPU benchmark rows (scripts/tpu_bench.sh) when BRIDGE_MR_TPU_BENCH is 1 (every
# part) or names parts ("tiny cnn50"). Tests and one or two parts end inside 9 minutes.
# No network there: torch 2.13.0 (a CPU build) comes from the machine's own wheels
# (/opt/wheels), optax and transformers from its package index (/opt/pypi/simple), torchax
# from ./.whl-tpu (carried: `pip download torchax==0.0.14.dev20261026 -d .whl-tpu`, and
# flatbuffers for the benchmarks' ttprof / replay parts: `pip download flatbuffers --no-deps
# -d .whl-tpu`); all under
# $BRIDGE_MR_TPU_SITE (default /tmp/site), last on PYTHONPATH so the machine's JAX stays first.
# bridge_mr itself runs from the checkout (PYTHONPATH). Logs go to "$OUT" (else ./tpu_logs).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/tpu_logs}
SITE=${BRIDGE_MR_TPU_SITE:-/tmp/site}
mkdir -p "$OUT"
started=$(date +%s)
if [ ! -d "$SITE/torch" ]; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: \
    --index-url file:///opt/pypi/simple --find-links /opt/wheels --no-compile --target "$SITE" \
    torch==2.13.0 optax transformers 2>&1 | tail -3
  if compgen -G ".whl-tpu/*.whl" >/dev/null; then
    PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps \
      --no-compile --no-cache-dir --upgrade --target "$SITE" .whl-tpu/*.whl 2>&1 | tail -3
  fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}:$SITE
echo "tpu_check: set-up took $(($(date +%s) - started)) s"
python3 -c 'import jax, torch; print("jax", jax.__version__, jax.devices(), "torch", torch.__version__)'

# The TPU leg: every test marked `tpu` (tests/tpu), JAX holding the chip in this one process.
tests_status=0
if [ "${BRIDGE_MR_TPU_TESTS:-1}" = 1 ]; then
  BRIDGE_MR_TPU=1 timeout -k 10 300 python3 -m pytest -m tpu tests/tpu -q -p no:cacheprovider \
    -rs --durations=5 2>&1 | tee "$OUT/pytest_tpu.txt"
  tests_status=${PIPESTATUS[0]}
  echo "tpu_check: tests exit $tests_status after $(($(date +%s) - started)) s"
fi

# The TorchTPU leg (BRIDGE_MR_TORCH_TPU=1): every test marked `torch_tpu`, TorchTPU holding the
# chip and JAX on the CPU, once scripts/torch_tpu_setup.sh has gathered torch_tpu's parts.
torch_tpu_status=0
if [ "${BRIDGE_MR_TORCH_TPU:-0}" = 1 ]; then
  if bash scripts/torch_tpu_setup.sh; then
    BRIDGE_MR_TORCH_TPU=1 JAX_PLATFORMS=cpu PYTHONPATH=/tmp/tt_site:$PYTHONPATH:/tmp/tt_deps \
      timeout -k 10 "${BRIDGE_MR_TORCH_TPU_S:-300}" python3 -m pytest -m torch_tpu \
      tests/tpu/test_torch_tpu.py -q -p no:cacheprovider -rs --durations=5 2>&1 \
      | tee "$OUT/pytest_torch_tpu.txt"
    torch_tpu_status=${PIPESTATUS[0]}
    echo "tpu_check: TorchTPU tests exit $torch_tpu_status after $(($(date +%s) - started)) s"
  else
    torch_tpu_status=3
  fi
fi

# Ordinary legs on the TPU host (BRIDGE_MR_TPU_SUITE: test paths): tests/conftest.py keeps them
# off the chip (JAX_PLATFORMS=cpu), on the host's simulated CPU devices as on any machine.
suite_status=0
if [ -n "${BRIDGE_MR_TPU_SUITE:-}" ]; then
  read -ra paths <<<"$BRIDGE_MR_TPU_SUITE"
  timeout -k 10 "${BRIDGE_MR_TPU_SUITE_S:-240}" python3 -m pytest "${paths[@]}" -q -x \
    -p no:cacheprovider -m "not slow and not xla and not x64" 2>&1 | tail -15 \
    | tee "$OUT/pytest_suite.txt"
  suite_status=${PIPESTATUS[0]}
  echo "tpu_check: suite exit $suite_status after $(($(date +%s) - started)) s"
fi

bench_status=0
case ${BRIDGE_MR_TPU_BENCH:-0} in
  0) ;;
  1) bash scripts/tpu_bench.sh; bench_status=$? ;;
  *) read -ra parts <<<"$BRIDGE_MR_TPU_BENCH"; bash scripts/tpu_bench.sh "${parts[@]}"; bench_status=$? ;;
esac
echo "tpu_check: tests $tests_status, TorchTPU tests $torch_tpu_status, suite $suite_status," \
  "benchmarks $bench_status, $(($(date +%s) - started)) s in all"
[ "$tests_status" -eq 0 ] && [ "$torch_tpu_status" -eq 0 ] && [ "$suite_status" -eq 0 ] \
  && [ "$bench_status" -eq 0 ]
