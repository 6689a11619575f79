#!/usr/bin/env python3
"""Batch-1 decode of ferry and of llama.cpp's own `llama-bench` on the same GGUF files, in one
invocation: for each file, `ferry bench model --batch 1` and `llama-bench -t T -p 0 -n N`,
alternated `--rounds` times (which one goes first alternates too), then each engine's best
rate, their ratio, every round's ratio, and ferry's weight-read GB/s against the read
bandwidth its bench measured and against the rate its batch-1 kernels consume the file's
weights from cache (`kernel GB/s`: where that is near the read bandwidth, decode is bound by
the kernels' arithmetic as much as by memory). The best of interleaved runs compares the two
at the same host state, which matters on shared machines whose speed drifts within minutes.
Standard library only.

    bash /work/shared/tools/build-llamacpp.sh          # llama-bench into ~/.cache/ferry/llama.cpp
    cargo build --release -p ferry
    python3 scripts/bench-llamacpp.py [GGUF ...] [--threads 2] [--tokens 128] [--rounds 3]

Without files it takes the F32, Q8_0 and default Q4_1 SmolLM2-135M files from the model
cache (`$FERRY_CACHE` or ~/.cache/ferry; `scripts/gguf-to-f32.py` makes the F32 and Q8_0
copies of the default file). Prints a table, then one JSON line.

With `--random-q4km` it benchmarks (alone, or beside the files given) a random-weight Llama
(hidden 2048, intermediate 5632, 4 layers, 16 heads, 4 KV heads, vocab 8192) quantized to
Q4_K_M by llama.cpp's own `llama-quantize` (next to llama-bench): made once into the model
cache (`scripts/random-llama-gguf.py` writes the F16 file, removed after quantizing), taken
from there afterwards.

    python3 scripts/bench-llamacpp.py --random-q4km --rounds 6

With `--prefill N` it compares prompt processing instead: `ferry bench model --batch 1
--prompt-len N --decode-steps 1` (prefill tok/s) against `llama-bench -p N -n 0`. (On the
machines here llama.cpp's batched quantized kernels die with SIGILL; its F32 ones run.)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

STEM = "SmolLM2-135M-Instruct"


def cache_dir():
    return Path(os.environ.get("FERRY_CACHE", Path.home() / ".cache" / "ferry"))


def default_files():
    models = cache_dir() / "models"
    return [str(models / f"{STEM}.{kind}.gguf") for kind in ("F32", "Q8_0", "Q4_1")]


RANDOM_Q4KM = "random-llama-h2048-i5632-l4.Q4_K_M.gguf"


def random_q4km(llama_bench):
    """The random Llama quantized to Q4_K_M by llama-quantize, made into the cache if missing."""
    out = cache_dir() / "models" / RANDOM_Q4KM
    if out.exists():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    quantize = Path(llama_bench).parent / "llama-quantize"
    if not quantize.exists():
        sys.exit(f"{quantize} is missing (bash /work/shared/tools/build-llamacpp.sh builds it)")
    f16 = out.with_suffix(".F16.tmp")
    script = Path(__file__).resolve().parent / "random-llama-gguf.py"
    subprocess.run([sys.executable, str(script), str(f16)], check=True, capture_output=True)
    env = dict(os.environ, LD_LIBRARY_PATH=str(quantize.parent))
    tmp = out.with_suffix(".tmp")
    try:
        subprocess.run([str(quantize), str(f16), str(tmp), "Q4_K_M"], env=env, check=True, capture_output=True)
        tmp.rename(out)
    finally:
        f16.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return str(out)


def default_ferry():
    target = Path(os.environ.get("CARGO_TARGET_DIR", Path(__file__).resolve().parent.parent / "target"))
    return str(target / "release" / "ferry")


def run_ferry(ferry, gguf, threads, tokens):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    cmd = [ferry, "bench", "model", "--model", gguf, "--batch", "1", "--prompt-len", "1",
           "--decode-steps", str(tokens), "--json"]
    out = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
    r = out["results"][0]
    return {
        "tok_s": r["decode_tok_s"],
        "weight_read_gb_s": r["decode_weight_read_gb_s"],
        "read_gb_s": out["read_gb_s"],
        "read_fraction": r["decode_read_bandwidth_fraction"],
        "kernel_gb_s": out["batch1_kernel_gb_s"],
        "kernel_fraction": r["decode_kernel_bound_fraction"],
        "weights_bytes_per_step": out["weights_bytes_per_step"],
        "weight_dtypes": out["weight_dtypes"],
    }


def run_ferry_prefill(ferry, gguf, threads, prompt):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    cmd = [ferry, "bench", "model", "--model", gguf, "--batch", "1", "--prompt-len", str(prompt),
           "--decode-steps", "1", "--json"]
    out = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
    r = out["results"][0]
    return {"tok_s": r["prefill_tok_s"], "gflop_s": r["prefill_gflop_s"],
            "peak_fraction": r["prefill_peak_fraction"], "fma_peak_gflop_s": out.get("fma_peak_gflop_s")}


def run_llama(llama_bench, gguf, threads, tokens, prompt=0):
    env = dict(os.environ, LD_LIBRARY_PATH=str(Path(llama_bench).parent))
    cmd = [llama_bench, "-m", gguf, "-t", str(threads), "-p", str(prompt), "-n", str(tokens),
           "-o", "json"]
    rows = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
    return {"tok_s": round(rows[0]["avg_ts"], 2), "stddev_tok_s": round(rows[0]["stddev_ts"], 2)}


def alternate(rounds, run_a, run_b):
    """Runs `run_a` and `run_b` `rounds` times, alternating which goes first, and returns each
    one's best result (highest tok/s), the ratio a/b of every round and every round's pair of
    rates [a, b]. On a shared host whose
    speed drifts by more than the gap being measured, the best of several interleaved runs
    compares the two engines at the host's same (fastest) state; one run of each compares
    whatever states they happened to meet."""
    best_a = best_b = None
    ratios = []
    pairs = []
    for i in range(rounds):
        if i % 2 == 0:
            a, b = run_a(), run_b()
        else:
            b, a = run_b(), run_a()
        pairs.append([a["tok_s"], b.get("tok_s")])
        if a["tok_s"] and b.get("tok_s"):
            ratios.append(round(a["tok_s"] / b["tok_s"], 2))
        if best_a is None or a["tok_s"] > best_a["tok_s"]:
            best_a = a
        if best_b is None or (b.get("tok_s") or 0) > (best_b.get("tok_s") or 0):
            best_b = b
    return best_a, best_b, ratios, pairs


def llama_or_error(run):
    try:
        return run()
    except subprocess.CalledProcessError as e:
        return {"tok_s": None, "error": (f"died (signal {-e.returncode})" if e.returncode < 0 else f"exit {e.returncode}")}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", nargs="*", help="GGUF files (default: F32, Q8_0, Q4_1 SmolLM2-135M)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128, help="decode tokens (llama-bench -n)")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="compare prefill of an N-token prompt instead of decode")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved runs of each engine; each engine's best is compared")
    ap.add_argument("--random-q4km", action="store_true",
                    help="benchmark the random Llama quantized to Q4_K_M by llama-quantize (made if missing)")
    ap.add_argument("--ferry", default=default_ferry())
    ap.add_argument("--llama-bench", default=str(cache_dir() / "llama.cpp" / "llama-bench"))
    args = ap.parse_args()
    files = list(args.gguf)
    if args.random_q4km:
        files.append(random_q4km(args.llama_bench))
    files = files or default_files()
    for f in files + [args.ferry, args.llama_bench]:
        if not Path(f).exists():
            sys.exit(f"{f} is missing (see the usage at the top of {sys.argv[0]})")

    results = []
    if args.prefill:
        print(f"{'file':<34} {'ferry prefill tok/s':>19} {'llama.cpp tok/s':>15} {'ratio':>6} "
              f"{'ferry GFLOP/s':>13} {'of peak':>7}")
        for gguf in files:
            ferry, llama, ratios, _ = alternate(
                args.rounds,
                lambda: run_ferry_prefill(args.ferry, gguf, args.threads, args.prefill),
                lambda: llama_or_error(lambda: run_llama(args.llama_bench, gguf, args.threads, 0, args.prefill)))
            ratio = round(ferry["tok_s"] / llama["tok_s"], 2) if llama["tok_s"] else None
            results.append({"gguf": gguf, "ferry": ferry, "llama_cpp": llama,
                            "ferry_over_llama_cpp": ratio, "round_ratios": ratios})
            shown = f"{llama['tok_s']:>15.1f}" if llama["tok_s"] else f"{llama['error']:>15}"
            print(f"{Path(gguf).name:<34} {ferry['tok_s']:>19.1f} {shown} "
                  f"{ratio if ratio is not None else '-':>6} {ferry['gflop_s']:>13.1f} "
                  f"{ferry['peak_fraction']:>7.2f}")
        print(json.dumps({"threads": args.threads, "prefill_tokens": args.prefill, "rounds": args.rounds,
                          "results": results}))
        return
    print(f"{'file':<34} {'ferry tok/s':>11} {'llama.cpp tok/s':>15} {'ratio':>6} "
          f"{'ferry GB/s':>10} {'read GB/s':>9} {'of read':>7} {'kernel GB/s':>11} {'of kernel':>9}")
    for gguf in files:
        ferry, llama, ratios, pairs = alternate(
            args.rounds,
            lambda: run_ferry(args.ferry, gguf, args.threads, args.tokens),
            lambda: run_llama(args.llama_bench, gguf, args.threads, args.tokens))
        ratio = round(ferry["tok_s"] / llama["tok_s"], 2)
        results.append({"gguf": gguf, "ferry": ferry, "llama_cpp": llama, "ferry_over_llama_cpp": ratio,
                        "round_ratios": ratios, "median_round_ratio": round(statistics.median(ratios), 2) if ratios else None,
                        "round_tok_s": pairs})
        print(f"{Path(gguf).name:<34} {ferry['tok_s']:>11.1f} {llama['tok_s']:>15.1f} {ratio:>6.2f} "
              f"{ferry['weight_read_gb_s']:>10.2f} {ferry['read_gb_s']:>9.2f} {ferry['read_fraction']:>7.2f} "
              f"{ferry['kernel_gb_s']:>11.2f} {ferry['kernel_fraction']:>9.2f}")
    print(json.dumps({"threads": args.threads, "tokens": args.tokens, "rounds": args.rounds, "results": results}))


if __name__ == "__main__":
    main()
