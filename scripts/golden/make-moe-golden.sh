#!/usr/bin/env bash
# Regenerates the tiny random-weight MoE model folders crates/ferry-model/tests/fixtures/moe/<case>/ and
# crates/ferry-model/tests/golden/moe.json with Hugging Face transformers (see make_moe.py).
#
# Needs a Python with torch, transformers (5.25), safetensors and numpy; by default a venv outside the
# repository (GOLDEN_VENV, default /tmp/golden-venv), created with:
#   python3 -m venv /tmp/golden-venv && /tmp/golden-venv/bin/pip install torch transformers safetensors numpy
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${GOLDEN_VENV:-/tmp/golden-venv}"

cd "$ROOT"
"$VENV/bin/python" scripts/golden/make_moe.py \
    --fixtures crates/ferry-model/tests/fixtures/moe --out crates/ferry-model/tests/golden
