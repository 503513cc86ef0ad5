#!/usr/bin/env bash
# The whole test suite on a fresh machine: builds its own virtual environments, installs the
# package (not editable, so the installed package is what gets tested) and runs pytest.
#   .venv      torch==2.13.0 + jax: lint, core, dlpack, torch_api tests
#   .venv-xla  torch==2.9.0 + torch_xla==2.9.0 + jax + flax: tests marked `xla`
# Set BRIDGE_MR_SKIP_XLA=1 to run only the main environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# jaxlib 0.10 on CPU: YNNPACK reduce fusion is slow (jax#37465). Main environment only:
# torch_xla 2.9's XLA aborts on this flag, so the XLA run must not inherit it.
MAIN_XLA_FLAGS="${XLA_FLAGS:-} --xla_cpu_experimental_ynn_fusion_type=-reduce"
export PIP_DISABLE_PIP_VERSION_CHECK=1

VENV=${BRIDGE_MR_VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV"/bin/pip install -q torch==2.13.0
"$VENV"/bin/pip install -q --force-reinstall --no-deps .
"$VENV"/bin/pip install -q ".[dev,examples,bench]"
"$VENV"/bin/ruff check .
"$VENV"/bin/ruff format --check .
XLA_FLAGS=$MAIN_XLA_FLAGS "$VENV"/bin/pytest -m "not xla" "$@"

if [ "${BRIDGE_MR_SKIP_XLA:-0}" != 1 ]; then
  bash scripts/setup_xla_env.sh
  PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .venv-xla/bin/pytest -m xla "$@"
fi
