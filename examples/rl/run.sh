#!/usr/bin/env bash
# Runs the GRPO example (examples/rl/grpo.py) on the default model, SmolLM2-135M-Instruct:
# builds ferry (release), fetches the model and converts it once to an f32 Hugging Face folder
# (`ferry make-model convert`), so that ferry serves and the trainer loads the very same f32
# weights, then trains with the venv that examples/rl/setup.sh made. Arguments go to grpo.py
# (e.g. --steps 40 --task wordcount --out DIR; --help lists them). Writes OUT/log.jsonl and
# OUT/plot.png (default OUT: examples/rl/runs/latest).
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=examples/rl/.venv/bin/python
[[ -x "$PY" ]] || { echo "run examples/rl/setup.sh first" >&2; exit 1; }

cargo build --release --locked -p ferry
ferry="${CARGO_TARGET_DIR:-target}/release/ferry"
cache="${FERRY_CACHE:-$HOME/.cache/ferry}"
model_dir="${RL_MODEL_DIR:-$cache/smollm2-135m-instruct-f32}"
if [[ ! -f "$model_dir/config.json" ]]; then
    gguf="$("$ferry" fetch-model)"
    "$ferry" make-model convert --model "$gguf" --out "$model_dir" >/dev/null
fi
exec "$PY" examples/rl/grpo.py --ferry "$ferry" --model-dir "$model_dir" "$@"
