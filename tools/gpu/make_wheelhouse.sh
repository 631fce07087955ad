#!/usr/bin/env bash
# Fills WHEELHOUSE (default wheelhouse/) with the wheels that `make install
# WHEELHOUSE=wheelhouse` needs on the GPU image and the image lacks: that image has Python
# 3.12 on x86-64, a CUDA torch and most of megabert's dependencies, and no registry.
#
#   tools/gpu/make_wheelhouse.sh            # run where pip reaches an index
#
# PYTHON (default .venv/bin/python, as `make install` leaves it) must hold torch: pip
# builds DeepSpeed's wheel (an sdist on PyPI) without build isolation, so that it does not
# fetch a multi-GB torch into a build env. Versions are those installed in PYTHON's env,
# which the CPU test suite runs with; a package not installed there is taken unpinned.
set -euo pipefail
cd "$(dirname "$0")/../.."

WHEELHOUSE=${WHEELHOUSE:-wheelhouse}
PYTHON=${PYTHON:-.venv/bin/python}
DEEPSPEED_SPEC=${DEEPSPEED_SPEC:-deepspeed==0.19.8}  # pyproject.toml: deepspeed>=0.19,<0.20
# What the image lacks of megabert's dependencies, its extras (deepspeed, mpi, test) and
# DeepSpeed's own (read from deepspeed's metadata: einops, msgpack, ninja, numpy, packaging,
# psutil, py-cpuinfo, tqdm are on the image; datasets, the test extra's peer of hard-negative mining, with
# dill and multiprocess are not). Checked against the image's package list of
# 2026-11 (/work/.library/device/KINDS.md in this workplace). typing-extensions is on the
# image, but pydantic-core needs a recent one (megatron-core likewise packaging>=24.2):
# pip takes the wheel only where the image's copy is too old.
MISSING=(hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions packaging
         zstandard mwparserfromhell megatron-core mpich datasets dill multiprocess)
# The image's platform: CPython 3.12, manylinux x86-64 (pip matches each tag exactly).
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  echo "make_wheelhouse: $PYTHON has no torch (needed to build DeepSpeed's wheel); run make install first or set PYTHON" >&2
  exit 1
fi
mkdir -p "$WHEELHOUSE"
specs=()
for name in "${MISSING[@]}"; do
  version=$("$PYTHON" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name" 2>/dev/null || true)
  specs+=("${name}${version:+==$version}")
done
# seqeval (finetune_ner.py's scores) is an sdist alone on PyPI too: a pure-Python wheel built here,
# in pip's isolated build env (against the venv's setuptools 84 its setup.py says version 0.0.0).
seqeval=$("$PYTHON" -c "import importlib.metadata as m; print(m.version('seqeval'))" 2>/dev/null || true)
"$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELHOUSE" "$DEEPSPEED_SPEC"
"$PYTHON" -m pip wheel -q --no-deps -w "$WHEELHOUSE" "seqeval${seqeval:+==$seqeval}"
"$PYTHON" -m pip download -q --no-deps "${TARGET[@]}" -d "$WHEELHOUSE" "${specs[@]}"
echo "make_wheelhouse: $(ls "$WHEELHOUSE"/*.whl | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f1) in $WHEELHOUSE"
