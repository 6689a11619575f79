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

With `--moe-bench` it benchmarks (alone, or beside the files given) the random Qwen3-MoE of
`ferry make-model moe --arch qwen3_moe --size bench` (hidden 1024, 8 layers, 32 experts of
256, top-8) as GGUF files: the folder written by `make-model` (seed 0),
`scripts/moe-folder-to-gguf.py` copies it into a `qwen3moe` F32 file, and llama-quantize
makes the Q4_1 and Q8_0 files from that (all made once into the model cache). For an MoE file
the JSON adds ferry's `moe` report (bytes read per decoded token, active, total) and the
phases of its decode step.

    python3 scripts/bench-llamacpp.py --moe-bench --tokens 64

With `--serve C` it compares serving instead: for each file, `llama-server -np C -cb`,
`ferry serve` and `ferry serve --enable-return-routed-experts` on the same file, all up at
once, and `ferry bench serve --concurrency C` against each in turn, `--rounds` times (the
order rotating each round; each round's request set, `--seed` = round, the same for all
three, and new each round, so no prefix cache carries over).

    python3 scripts/bench-llamacpp.py --moe-bench --serve 32 --rounds 2
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


MOE_STEM = "qwen3-moe-bench"


def moe_bench(ferry, llama_bench):
    """The Qwen3-MoE bench model as F32, Q8_0 and Q4_1 GGUF files, made into the cache if missing."""
    models = cache_dir() / "models"
    out = {kind: models / f"{MOE_STEM}.{kind}.gguf" for kind in ("F32", "Q8_0", "Q4_1")}
    if all(p.exists() for p in out.values()):
        return {k: str(p) for k, p in out.items()}
    models.mkdir(parents=True, exist_ok=True)
    quantize = Path(llama_bench).parent / "llama-quantize"
    if not quantize.exists():
        sys.exit(f"{quantize} is missing (bash /work/shared/tools/build-llamacpp.sh builds it)")
    if not out["F32"].exists():
        folder = models / MOE_STEM
        if not (folder / "model.safetensors").exists():
            subprocess.run([ferry, "make-model", "moe", "--arch", "qwen3_moe", "--size", "bench",
                            "--out", str(folder)], check=True, capture_output=True)
        script = Path(__file__).resolve().parent / "moe-folder-to-gguf.py"
        tmp = out["F32"].with_suffix(".tmp")
        subprocess.run([sys.executable, str(script), str(folder), str(tmp)], check=True, capture_output=True)
        tmp.rename(out["F32"])
    env = dict(os.environ, LD_LIBRARY_PATH=str(quantize.parent))
    for kind in ("Q8_0", "Q4_1"):
        if out[kind].exists():
            continue
        tmp = out[kind].with_suffix(".tmp")
        try:
            subprocess.run([str(quantize), str(out["F32"]), str(tmp), kind], env=env, check=True,
                           capture_output=True)
            tmp.rename(out[kind])
        finally:
            tmp.unlink(missing_ok=True)
    return {k: str(p) for k, p in out.items()}


def default_ferry():
    target = Path(os.environ.get("CARGO_TARGET_DIR", Path(__file__).resolve().parent.parent / "target"))
    return str(target / "release" / "ferry")


def run_ferry(ferry, gguf, threads, tokens):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    cmd = [ferry, "bench", "model", "--model", gguf, "--batch", "1", "--prompt-len", "1",
           "--decode-steps", str(tokens), "--json"]
    out = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
    r = out["results"][0]
    res = {
        "tok_s": r["decode_tok_s"],
        "weight_read_gb_s": r["decode_weight_read_gb_s"],
        "read_gb_s": out["read_gb_s"],
        "read_fraction": r["decode_read_bandwidth_fraction"],
        "kernel_gb_s": out["batch1_kernel_gb_s"],
        "kernel_fraction": r["decode_kernel_bound_fraction"],
        "weights_bytes_per_step": out["weights_bytes_per_step"],
        "weight_dtypes": out["weight_dtypes"],
    }
    if out.get("moe"):
        res["moe"] = out["moe"]
        res["decode_ms_per_step"] = r["decode_ms_per_step"]
        res["decode_phase_us_per_step"] = r["decode_phase_us_per_step"]
    return res


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


def wait_up(url, proc, seconds=300):
    import time
    import urllib.request
    start = time.time()
    while time.time() - start < seconds:
        if proc.poll() is not None:
            return f"exited ({proc.returncode})"
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                if r.status == 200:
                    return None
        except Exception:
            pass
        time.sleep(1)
    return "not up"


def serve_compare(args, gguf):
    """`ferry bench serve` against llama-server, ferry serve and ferry serve with routed
    experts on one file, all three up at once, `--rounds` rounds with the order rotating."""
    c = args.serve
    ctx = c * (args.serve_prompt + args.serve_output + 16)
    lib = str(Path(args.llama_bench).parent)
    servers = {
        "llama_cpp": ([str(Path(lib) / "llama-server"), "-m", gguf, "-np", str(c), "-cb", "-c", str(ctx),
                       "-t", str(args.threads), "-tb", str(args.threads), "--host", "127.0.0.1",
                       "--port", "8471"], "http://127.0.0.1:8471", dict(os.environ, LD_LIBRARY_PATH=lib)),
        "ferry": ([args.ferry, "serve", "--model", gguf, "--port", "8472"], "http://127.0.0.1:8472",
                  dict(os.environ, RAYON_NUM_THREADS=str(args.threads))),
        "ferry_routed_experts": ([args.ferry, "serve", "--model", gguf, "--port", "8473",
                                  "--enable-return-routed-experts"], "http://127.0.0.1:8473",
                                 dict(os.environ, RAYON_NUM_THREADS=str(args.threads))),
    }
    servers = {n: s for n, s in servers.items() if n in args.serve_engines.split(",")}
    import tempfile
    procs, logs, runs, errors = {}, {}, {name: [] for name in servers}, {}
    try:
        for name, (cmd, url, env) in servers.items():
            # A file, not a pipe: llama-server logs every request, and a full pipe would stall it.
            logs[name] = tempfile.TemporaryFile()
            procs[name] = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=logs[name])
        for name, (_, url, _) in servers.items():
            err = wait_up(url, procs[name])
            if err:
                logs[name].seek(0)
                errors[name] = err + ": " + logs[name].read().decode(errors="replace")[-400:]
        names = [n for n in servers if n not in errors]
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                if procs[name].poll() is not None:
                    errors[name] = f"died (signal {-procs[name].returncode})" if procs[name].returncode < 0 \
                        else f"exit {procs[name].returncode}"
                    continue
                cmd = [args.ferry, "bench", "serve", "--url", servers[name][1], "--num-requests",
                       str(args.serve_requests), "--concurrency", str(c), "--prompt-len", str(args.serve_prompt),
                       "--output-len", str(args.serve_output), "--vocab-size", str(args.serve_vocab),
                       "--seed", str(r), "--json"]
                p = subprocess.run(cmd, capture_output=True, text=True)
                if p.returncode != 0:
                    errors[name] = f"bench serve exit {p.returncode}: {p.stderr[-400:]}"
                    continue
                rep = json.loads(p.stdout.strip().splitlines()[-1])
                runs[name].append({
                    "round": r,
                    "output_tok_s": round(rep["output_token_throughput_per_s"], 1),
                    "completed": rep["n_completed"], "failed": rep["n_failed"],
                    "output_len_mismatch": rep.get("n_output_len_mismatch"),
                    "ttft_p50_ms": rep["ttft_ms"]["p50"], "tpot_p50_ms": rep["tpot_ms"]["p50"],
                    "itl_p99_ms": rep["itl_ms"]["p99"], "duration_s": round(rep["duration_s"], 2),
                    "engine_overhead_fraction": rep.get("engine_overhead_fraction"),
                    "failures": rep["failures"][:2],
                })
    finally:
        for name, p in procs.items():
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
    def ratios(a, b):
        if a not in runs or b not in runs:
            return None
        return [round(x["output_tok_s"] / y["output_tok_s"], 3) for x, y in zip(runs[a], runs[b])
                if x["output_tok_s"] and y["output_tok_s"] and x["round"] == y["round"]]
    return {"gguf": gguf, "concurrency": c, "runs": runs, "errors": errors,
            "ferry_over_llama_cpp": ratios("ferry", "llama_cpp"),
            "routed_experts_over_ferry": ratios("ferry_routed_experts", "ferry")}


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


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
    ap.add_argument("--moe-bench", action="store_true",
                    help="benchmark the Qwen3-MoE bench model's Q4_1 and Q8_0 GGUF files (made if missing)")
    ap.add_argument("--serve", type=int, default=0, metavar="C",
                    help="compare serving at concurrency C (llama-server, ferry serve, with routed experts)")
    ap.add_argument("--serve-engines", default="llama_cpp,ferry,ferry_routed_experts",
                    help="which of llama_cpp, ferry, ferry_routed_experts to serve")
    ap.add_argument("--serve-requests", type=int, default=64)
    ap.add_argument("--serve-prompt", type=int, default=128)
    ap.add_argument("--serve-output", type=int, default=128)
    ap.add_argument("--serve-vocab", type=int, default=297,
                    help="random prompt ids stay below this (297: the MoE bench model's ordinary tokens)")
    ap.add_argument("--ferry", default=default_ferry())
    ap.add_argument("--llama-bench", default=str(cache_dir() / "llama.cpp" / "llama-bench"))
    args = ap.parse_args()
    files = list(args.gguf)
    if args.random_q4km:
        files.append(random_q4km(args.llama_bench))
    if args.moe_bench:
        moe = moe_bench(args.ferry, args.llama_bench)
        files += [moe["Q4_1"], moe["Q8_0"]]
    files = files or default_files()
    for f in files + [args.ferry, args.llama_bench]:
        if not Path(f).exists():
            sys.exit(f"{f} is missing (see the usage at the top of {sys.argv[0]})")

    if args.serve:
        results = []
        for gguf in files:
            res = serve_compare(args, gguf)
            results.append(res)
            for name, rs in res["runs"].items():
                print(f"{Path(gguf).name:<34} {name:<22} output tok/s "
                      + ", ".join(str(x["output_tok_s"]) for x in rs))
            for name, err in res["errors"].items():
                print(f"{Path(gguf).name:<34} {name:<22} {err}")
        print(json.dumps({"cpu": cpu_name(), "threads": args.threads, "rounds": args.rounds,
                          "requests": args.serve_requests, "prompt_len": args.serve_prompt,
                          "output_len": args.serve_output, "results": results}))
        return

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
        print(json.dumps({"cpu": cpu_name(), "threads": args.threads, "prefill_tokens": args.prefill, "rounds": args.rounds,
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
        def num(v, w):
            return f"{v:>{w}.2f}" if v is not None else f"{'-':>{w}}"
        print(f"{Path(gguf).name:<34} {ferry['tok_s']:>11.1f} {llama['tok_s']:>15.1f} {ratio:>6.2f} "
              f"{ferry['weight_read_gb_s']:>10.2f} {ferry['read_gb_s']:>9.2f} {ferry['read_fraction']:>7.2f} "
              f"{num(ferry['kernel_gb_s'], 11)} {num(ferry['kernel_fraction'], 9)}")
    print(json.dumps({"cpu": cpu_name(), "threads": args.threads, "tokens": args.tokens, "rounds": args.rounds, "results": results}))


if __name__ == "__main__":
    main()
