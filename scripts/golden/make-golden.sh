#!/usr/bin/env bash
# Regenerates crates/ferry-model/tests/golden/{tiny,smollm2}.json with Hugging Face transformers.
#
# Needs a Python with torch, transformers, gguf, numpy, accelerate and tokenizers; by default a venv outside
# the repository (GOLDEN_VENV, default /tmp/golden-venv), created with:
#   python3 -m venv /tmp/golden-venv && /tmp/golden-venv/bin/pip install torch transformers gguf numpy accelerate
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${GOLDEN_VENV:-/tmp/golden-venv}"
TINY_DIR="$(mktemp -d)"
trap 'rm -rf "$TINY_DIR"' EXIT

cd "$ROOT"
cargo build -q -p ferry
./target/debug/ferry make-model tiny --out "$TINY_DIR" >/dev/null
GGUF="$(bash scripts/fetch-model.sh)"
"$VENV/bin/python" scripts/golden/make_golden.py \
    --tiny-dir "$TINY_DIR" --gguf "$GGUF" --out crates/ferry-model/tests/golden
