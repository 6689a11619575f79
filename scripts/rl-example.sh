#!/usr/bin/env bash
# CI test of the RL example (examples/rl/grpo.py): a few GRPO steps on the tiny model, served by
# the already-built target/debug/ferry (`--model tiny`, admin API on), with the trainer on the
# same weights from `ferry make-model tiny`. Its checks: every token's logprob from ferry equals
# the trainer's under the weights that generated that token (the trainer keeps the previous
# version) within 1e-4; every rollout's `weight_versions` lists the versions its tokens came
# from, in order (the weight update lands in the middle of a batch); no request is lost. They
# print cargo-style lines, so scripts/test.sh counts them with cargo's tests.
#
# The trainer needs PyTorch; Debian's CPU-only python3-torch (1.13, ~150 MB of packages) is
# installed with apt-get when no python3 here can import torch (PyPI's torch wheel brings
# several GB of CUDA libraries). RL_PYTHON picks an interpreter that has torch.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=target/debug/ferry

fail() {
    echo "rl-example: $*" >&2
    echo "test result: FAILED. 0 passed; 1 failed; 0 ignored (rl-example setup)"
    exit 1
}

[[ -x "$BIN" ]] || fail "$BIN is not built (cargo build -p ferry)"

has_torch() { "$1" -c 'import torch, numpy' >/dev/null 2>&1; }
py=""
for cand in ${RL_PYTHON:-} python3 /usr/bin/python3; do
    if command -v "$cand" >/dev/null 2>&1 && has_torch "$cand"; then
        py="$cand"
        break
    fi
done
if [[ -z "$py" ]]; then
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
        start=$SECONDS
        echo "rl-example: installing Debian's python3-torch (CPU) with apt-get" >&2
        export DEBIAN_FRONTEND=noninteractive
        { apt-get update -qq && apt-get install -y -qq --no-install-recommends python3-torch; } >/dev/null ||
            fail "apt-get install python3-torch failed"
        echo "rl-example: installed in $((SECONDS - start)) s" >&2
    fi
    has_torch /usr/bin/python3 || fail "no python3 with torch (set RL_PYTHON, or run as root for apt-get)"
    py=/usr/bin/python3
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$BIN" make-model tiny --out "$work/tiny" >/dev/null || fail "ferry make-model tiny failed"

# 4 steps of 3 prompts x 4 samples of 64 tokens; a large learning rate, so each version's
# logprobs differ from the next one's by far more than the tolerance.
"$py" examples/rl/grpo.py --check --no-plot --ferry "$BIN" \
    --model-dir "$work/tiny" --serve-model tiny --trainer mini --task even-tokens \
    --steps 4 --prompts 3 --group 4 --max-tokens 64 --ignore-eos --lr 1e-2 \
    --pause-mid-rollout --threads 1 --bucket-bytes 100000 --out "$work/run"
