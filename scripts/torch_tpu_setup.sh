#!/usr/bin/env bash
# TorchTPU for the TorchTPU leg on a TPU host, which has no network: torch_tpu 0.2.0, libtpu
# 0.0.51 (which torch_tpu needs; the machine's JAX keeps its own) and portpicker travel as one xz
# tarball of their unpacked wheels (210 MB), in 4 parts of 53 MB, one device call each.
#
#   bash scripts/torch_tpu_setup.sh --pack   # here: download, pack and split into ./.whl-tt
#   bash scripts/torch_tpu_setup.sh          # there, each call carrying one part (and the
#                                            # .whl-tt/bundle.sha256): gathers the parts under
#                                            # /tmp/tt_parts; once all 4 are there, checks and
#                                            # unpacks them into /tmp/tt_site and installs the
#                                            # rest of torch_tpu's needs from the machine's index
#                                            # into /tmp/tt_deps. Exit 0 once ready, 3 before.
#
# Use: PYTHONPATH=/tmp/tt_site:$PYTHONPATH:/tmp/tt_deps JAX_PLATFORMS=cpu (libtpu 0.0.51 first,
# for torch_tpu; JAX stays on the CPU and only traces). scripts/tpu_check.sh does so.
set -uo pipefail
cd "$(dirname "$0")/.."
PARTS=4
if [ "${1:-}" = --pack ]; then
  set -e
  work=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
    --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux2014_x86_64 -d "$work/wheels" torch_tpu==0.2.0 libtpu==0.0.51 \
    portpicker==1.6.0
  mkdir -p "$work/tree" .whl-tt
  for wheel in "$work"/wheels/*.whl; do python3 -m zipfile -e "$wheel" "$work/tree"; done
  tar -C "$work/tree" -c . | xz -T0 -7 >"$work/bundle.tar.xz"
  rm -f .whl-tt/part_*
  split -n "$PARTS" -d "$work/bundle.tar.xz" .whl-tt/part_
  sha256sum "$work/bundle.tar.xz" | cut -d' ' -f1 >.whl-tt/bundle.sha256
  rm -rf "$work"
  ls -l .whl-tt
  exit 0
fi
SITE=/tmp/tt_site
DEPS=/tmp/tt_deps
if [ -f "$SITE/.ready" ]; then
  echo "torch_tpu_setup: ready ($SITE)"
  exit 0
fi
mkdir -p /tmp/tt_parts
cp .whl-tt/part_* .whl-tt/bundle.sha256 /tmp/tt_parts/ 2>/dev/null
have=$(find /tmp/tt_parts -name 'part_*' | wc -l)
echo "torch_tpu_setup: $have of $PARTS parts"
[ "$have" -ge "$PARTS" ] || exit 3
cat /tmp/tt_parts/part_* >/tmp/tt_bundle.tar.xz
if [ "$(sha256sum /tmp/tt_bundle.tar.xz | cut -d' ' -f1)" != "$(cat /tmp/tt_parts/bundle.sha256)" ]; then
  echo "torch_tpu_setup: the joined parts do not match bundle.sha256; send them again"
  rm -rf /tmp/tt_parts /tmp/tt_bundle.tar.xz
  exit 1
fi
mkdir -p "$SITE" "$DEPS"
python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' \
  /tmp/tt_bundle.tar.xz "$SITE" || exit 1
rm -f /tmp/tt_bundle.tar.xz
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: \
  --index-url file:///opt/pypi/simple --no-compile --target "$DEPS" \
  frozendict immutabledict pyzmq tensorboard absl-py 2>&1 | tail -3
touch "$SITE/.ready"
echo "torch_tpu_setup: ready ($SITE, $DEPS)"
