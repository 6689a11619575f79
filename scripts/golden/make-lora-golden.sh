#!/usr/bin/env bash
# Regenerates the tiny random-weight base models and LoRA adapters crates/ferry-model/tests/fixtures/lora/ and
# crates/ferry-model/tests/golden/lora.json with Hugging Face transformers and peft (see make_lora.py).
#
# Needs a Python with torch, transformers (5.25), peft (0.22.0, the version make_lora.py is pinned to) and
# safetensors; by default a venv outside the repository (GOLDEN_VENV, default /tmp/golden-venv), created with:
#   python3 -m venv /tmp/golden-venv && /tmp/golden-venv/bin/pip install torch transformers safetensors peft==0.22.0
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${GOLDEN_VENV:-/tmp/golden-venv}"

cd "$ROOT"
# target_modules "all-linear" is saved as a set of module paths: a fixed hash seed keeps its order.
export PYTHONHASHSEED=0
"$VENV/bin/python" scripts/golden/make_lora.py \
    --fixtures crates/ferry-model/tests/fixtures/lora --out crates/ferry-model/tests/golden
