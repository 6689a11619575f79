#!/usr/bin/env python3
"""Decode tokens/s of llama.cpp (through llama-cpp-python) on a GGUF, for comparison with
`ferry bench model`. Batch 1, greedy, the same prompt length and number of decode steps.

    python3 -m venv /tmp/llamacpp-venv && /tmp/llamacpp-venv/bin/pip install llama-cpp-python
    /tmp/llamacpp-venv/bin/python scripts/bench-llamacpp.py MODEL.gguf --threads 2

Prints one JSON line.
"""
import argparse
import json
import time

from llama_cpp import Llama


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    llm = Llama(model_path=args.gguf, n_ctx=args.prompt_len + args.decode_steps + 8,
                n_threads=args.threads, n_threads_batch=args.threads, n_batch=512,
                verbose=False)
    prompt = [(i * 7919) % 40000 + 100 for i in range(args.prompt_len)]
    best_decode, best_prefill = 0.0, 0.0
    for _ in range(args.repeats):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        tok = int(max(range(llm.n_vocab()), key=lambda i: llm.scores[llm.n_tokens - 1][i]))
        t_decode = 0.0
        for _ in range(args.decode_steps):
            s = time.perf_counter()
            llm.eval([tok])
            t_decode += time.perf_counter() - s
            tok = int(llm.scores[llm.n_tokens - 1].argmax())
        best_prefill = max(best_prefill, args.prompt_len / (t1 - t0))
        best_decode = max(best_decode, args.decode_steps / t_decode)
    print(json.dumps({
        "engine": "llama.cpp (llama-cpp-python)",
        "gguf": args.gguf,
        "threads": args.threads,
        "prompt_len": args.prompt_len,
        "prefill_tok_s": round(best_prefill, 1),
        "decode_batch1_tok_s": round(best_decode, 1),
    }))


if __name__ == "__main__":
    main()
