#!/usr/bin/env bash
# Builds (or refreshes) .venv-xla: the torch-xla test environment, separate from .venv because
# torch_xla 2.9.0 needs torch==2.9.0 exactly. Idempotent: dependencies are installed only when
# the venv does not already have the pinned versions; the repo package is always reinstalled
# (not editable, so the installed package is what gets tested).
#   bash scripts/setup_xla_env.sh        # then: PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .venv-xla/bin/pytest -m xla
# A fresh install downloads about 3.5 GB (torch's CUDA wheels, which also run on CPU) and takes
# 7.8 GB of disk. PYTHON selects the interpreter (default python3; torch_xla 2.9.0 has wheels
# for CPython 3.10 to 3.13).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-xla
export PIP_DISABLE_PIP_VERSION_CHECK=1

# Pins that must hold together: torch_xla 2.9.0 requires torch 2.9.0 exactly; jax 0.10.2 is the
# version the main environment resolves to, and its lowered HLO runs in torch_xla 2.9.0 (checked
# from jax 0.7.1 to 0.10.2, see docs/torch_xla_notes.md); flax is what torch_xla's call_jax imports;
# drjax (as pinned in pyproject's dev extra) because pytest collects every test module here too.
PINNED=(torch==2.9.0 torch_xla==2.9.0 jax==0.10.2 jaxlib==0.10.2 flax==0.12.8 drjax==0.2.1)
# Lower bounds from pyproject.toml (the examples extra too: examples/fedavg_xla.py and its test
# load scikit-learn's digits), plus what builds the package without build isolation.
UNPINNED=("numpy>=1.26" "ml_dtypes>=0.5" "typing-extensions>=4.9" "pytest>=8" "hypothesis>=6.100"
  "scikit-learn>=1.4" "tqdm>=4.66" "setuptools>=68" wheel)

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"

# True when every pinned distribution is installed at its exact version and every other one is
# installed at all; reads package metadata only (no heavy imports), so it takes well under 1 s.
satisfied() {
  "$VENV/bin/python" - "${PINNED[@]}" "${UNPINNED[@]}" <<'EOF'
import re
import sys
from importlib import metadata

for requirement in sys.argv[1:]:
    name, op, wanted = re.match(r"([A-Za-z0-9_.-]+)(==|>=)?(.*)", requirement).groups()
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        sys.exit(1)
    if op == "==" and installed != wanted:
        sys.exit(1)
EOF
}

if ! satisfied; then
  "$VENV/bin/pip" install -q "${PINNED[@]}" "${UNPINNED[@]}"
fi
# bridge_mr.from_torch's engine, pinned as in pyproject's from_torch extra. torch_xla's wheel
# ships an old torchax (0.0.6) in the same directory, so that copy is removed first: installing
# over it would leave its stale modules behind.
TORCHAX=0.0.14.dev20261026
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if ! grep -q "__version__ = \"$TORCHAX\"" "$SITE/torchax/__init__.py" 2>/dev/null; then
  rm -rf "$SITE/torchax"
  "$VENV/bin/pip" install -q --no-deps --force-reinstall "torchax==$TORCHAX"
fi
"$VENV/bin/pip" install -q --no-deps --no-build-isolation --force-reinstall .
