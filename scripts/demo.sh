#!/usr/bin/env bash
# The demo on a fresh machine: creates .venv if missing, installs torch==2.13.0 (pinned: an
# unpinned torch pulls a multi-GB CUDA build) and this package with its examples extra, then
# runs `python -m bridge_mr.demo`. Arguments go to the demo, e.g. --quick, --rounds 100,
# --clients 32, --torch-threads 2, --no-baseline. It prints each implementation's first round
# apart from its later rounds, bridge_mr against each baseline, and where bridge_mr is slower.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

VENV=${BRIDGE_MR_VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV"/bin/pip install -q torch==2.13.0
"$VENV"/bin/pip install -q ".[examples]"
exec "$VENV"/bin/python -m bridge_mr.demo "$@"
