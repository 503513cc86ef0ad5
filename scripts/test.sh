#!/usr/bin/env bash
# The whole test suite on a fresh machine: builds its own virtual environments, installs the
# package (not editable, so the installed package is what gets tested) and runs pytest.
#   .venv      torch==2.13.0 + jax: lint, core, dlpack, torch_api tests, types
#   .venv-notorch  jax + the beam extra, no torch: Beam on Dask workers, the torch-free layout
#   .venv-xla  torch==2.9.0 + torch_xla==2.9.0 + jax + flax: tests marked `xla`, and the compat
#              layer's fast-path tests and from_torch's tests on torch 2.9
# Each environment runs twice: with JAX's 64-bit mode off (the default, as users run JAX), then
# with BRIDGE_MR_X64=1 the tests marked `x64` only (see tests/conftest.py).
# Set BRIDGE_MR_SKIP_XLA=1 to run only the main environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# XLA_FLAGS: tests/conftest.py adds 8 simulated CPU devices, nothing else (bridge_mr chooses
# XLA's CPU options per program).
export PIP_DISABLE_PIP_VERSION_CHECK=1

VENV=${BRIDGE_MR_VENV:-.venv}

# Each step's time, so that a log tells where a run's minutes go.
step_start=$SECONDS
took() {
  echo "scripts/test.sh: $1 took $((SECONDS - step_start)) s ($SECONDS s in all)"
  step_start=$SECONDS
}

# The environments a fresh clone builds take about 12 GB (.venv 2.6, .venv-notorch 1.1,
# .venv-xla 7.8); pip's "No space left on device" halfway through says less than the numbers.
need_mb=0
[ -x "$VENV/bin/python" ] || need_mb=$((need_mb + 2700))
[ -x .venv-notorch/bin/python ] || need_mb=$((need_mb + 1200))
if [ "${BRIDGE_MR_SKIP_XLA:-0}" != 1 ] && [ ! -x .venv-xla/bin/python ]; then
  need_mb=$((need_mb + 8000))
fi
free_mb=$(df -Pm . | awk 'NR == 2 {print $4}')
echo "scripts/test.sh: ${free_mb} MB free here; the environments still to build take about ${need_mb} MB"
if [ "$free_mb" -lt "$need_mb" ]; then
  echo "scripts/test.sh: not enough disk for the test environments: ${need_mb} MB needed, ${free_mb} MB free in $(pwd); free some space (or set BRIDGE_MR_SKIP_XLA=1 to skip .venv-xla's 8 GB)" >&2
  exit 1
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV"/bin/pip install -q torch==2.13.0
"$VENV"/bin/pip install -q --force-reinstall --no-deps .
"$VENV"/bin/pip install -q ".[dev,examples,bench]"
took "$VENV's set-up"
"$VENV"/bin/ruff check .
"$VENV"/bin/ruff format --check .
took "ruff"

# One pytest leg; exit status 5 (no test selected: `scripts/test.sh tests/jax_core` has no
# x64-marked tests) is not a failure.
leg() { env "$@" || [ $? = 5 ]; }

# Two pytest workers (pytest-xdist; worksteal: the slow tests do not wait behind one worker):
# the main leg took 1,156 s instead of 1,835 on 2 cores, where one process kept 1.4 busy.
WORKERS=(-n 2 --dist worksteal)
leg "$VENV"/bin/pytest "${WORKERS[@]}" -m "not xla and not x64" "$@"
took "the main leg"
leg BRIDGE_MR_X64=1 "$VENV"/bin/pytest "${WORKERS[@]}" -m "x64 and not xla" "$@"
took "the x64 leg"
# Types of bridge_mr/ (configured in pyproject.toml), against this environment's torch and jax.
"$VENV"/bin/basedpyright --pythonpath "$VENV/bin/python"
took "basedpyright"

# Without torch: the package's dependencies do not pull it in, and bridge_mr.jax_core and Beam
# (the driver and the Dask workers) run where it is not installed at all.
NOTORCH=.venv-notorch
[ -x "$NOTORCH/bin/python" ] || "$PYTHON" -m venv "$NOTORCH"
"$NOTORCH"/bin/pip install -q --force-reinstall --no-deps .
"$NOTORCH"/bin/pip install -q ".[beam]" "pytest>=8" "hypothesis>=6.100"
if "$NOTORCH"/bin/python -c "import importlib.util as u; raise SystemExit(u.find_spec('torch') is None)"; then
  echo "torch is installed in $NOTORCH: a dependency pulled it in" >&2
  exit 1
fi
took "$NOTORCH's set-up"
leg "$NOTORCH"/bin/pytest -m "not xla and not x64" tests/beam/test_dask.py tests/beam/test_maps.py \
  tests/test_imports.py::test_without_torch_plain_jax_runs_and_torch_names_say_how_to_install_it \
  tests/test_imports.py::test_the_installed_package_requires_torch_only_through_its_extras
took "the no-torch leg"

if [ "${BRIDGE_MR_SKIP_XLA:-0}" != 1 ]; then
  bash scripts/setup_xla_env.sh
  took ".venv-xla's set-up"
  export PJRT_DEVICE=CPU CPU_NUM_DEVICES=4
  leg .venv-xla/bin/pytest -m "xla and not x64" "$@"
  leg BRIDGE_MR_X64=1 .venv-xla/bin/pytest -m "xla and x64" "$@"
  if [ -d tests/compat ]; then
    leg .venv-xla/bin/pytest -m "not xla and not x64" tests/compat
  fi
  took "the xla legs (xla, xla x64, compat)"
  # from_torch on torch 2.9 (torchax's lowering differs between torch releases); its own
  # process, apart from the XLA-device tests.
  leg .venv-xla/bin/pytest -m "not xla and not x64" tests/torch_fn
  took "from_torch on torch 2.9"
fi
