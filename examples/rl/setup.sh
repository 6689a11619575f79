#!/usr/bin/env bash
# Creates the RL example's virtual environment, examples/rl/.venv, with pip: PyTorch (CPU is
# enough; PyPI's Linux wheel brings its CUDA libraries too, a few GB), transformers, numpy and
# matplotlib. Idempotent. PYTHON picks the interpreter (default python3, 3.10 or newer).
#
# Then: examples/rl/run.sh (see the README's "RL example" section).
set -euo pipefail
cd "$(dirname "$0")"

PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
# Versions the example was run with.
PACKAGES=(torch==2.15.0 transformers==5.23.0 matplotlib==3.11.2 numpy)

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
"$VENV/bin/python" -m pip install --disable-pip-version-check "${PACKAGES[@]}"
"$VENV/bin/python" - <<'PY'
import torch, transformers, matplotlib
print(f"torch {torch.__version__}, transformers {transformers.__version__}, matplotlib {matplotlib.__version__}")
PY
echo "venv ready: $(pwd)/$VENV"
