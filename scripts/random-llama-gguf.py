#!/usr/bin/env python3
"""Writes a Llama-architecture GGUF with random F16 weights (norms F32 ones) and a small
byte-level BPE vocabulary that both ferry and llama.cpp load: the input for
`llama-quantize in.gguf out.gguf Q4_K_M`, so a K-quant file made by llama.cpp's own quantizer
can be benchmarked without a download. Standard library only (the random f16 values come
from random bytes: a random sign and mantissa, an exponent of 2^-7..2^-5).

    python3 scripts/random-llama-gguf.py OUT.gguf [--hidden 2048] [--intermediate 5632]
        [--layers 4] [--heads 16] [--kv-heads 4] [--vocab 8192] [--seed 0]
"""
import argparse
import random
import struct

# GGUF value types and GGML tensor types used here.
U32, I32, F32, BOOL, STRING, ARRAY = 4, 5, 6, 7, 8, 9
GGML_F32, GGML_F16 = 0, 1
ALIGN = 32


def s(text):
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def kv(key, kind, value):
    out = s(key) + struct.pack("<I", kind)
    if kind == U32:
        return out + struct.pack("<I", value)
    if kind == F32:
        return out + struct.pack("<f", value)
    if kind == BOOL:
        return out + struct.pack("<B", 1 if value else 0)
    if kind == STRING:
        return out + s(value)
    elem, items = value
    out += struct.pack("<IQ", elem, len(items))
    if elem == STRING:
        return out + b"".join(s(i) for i in items)
    return out + struct.pack(f"<{len(items)}i", *items)


def byte_alphabet():
    """GPT-2's byte-to-character table: the spelling of the 256 byte tokens."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def vocabulary(size):
    """The 256 byte tokens, then merged pairs and triples of letters and digits (each with
    its merge), then `<|endoftext|>`."""
    tokens = byte_alphabet()
    merges = []
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    seen = set(tokens)
    pairs = [a + b for a in chars for b in chars]
    candidates = [(p[0], p[1]) for p in pairs] + [(p, c) for p in pairs for c in chars]
    for a, b in candidates:
        if len(tokens) >= size - 1:
            break
        if a + b in seen:
            continue
        seen.add(a + b)
        tokens.append(a + b)
        merges.append(f"{a} {b}")
    tokens.append("<|endoftext|>")
    return tokens, merges


def random_f16(n, rng):
    """n random f16 values as bytes: uniform low byte; high byte: sign, exponent 8..10
    (2^-7..2^-5), two mantissa bits."""
    table = bytes(((b & 0x80) | ((8 + (b >> 2) % 3) << 2) | (b & 3)) for b in range(256))
    low = rng.randbytes(n)
    high = rng.randbytes(n).translate(table)
    out = bytearray(2 * n)
    out[0::2] = low
    out[1::2] = high
    return bytes(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    head_dim = a.hidden // a.heads
    kv_dim = head_dim * a.kv_heads
    tokens, merges = vocabulary(a.vocab)
    eos = len(tokens) - 1
    meta = [
        kv("general.architecture", STRING, "llama"),
        kv("general.name", STRING, f"random-llama-h{a.hidden}"),
        kv("general.file_type", U32, 1),
        kv("llama.context_length", U32, 4096),
        kv("llama.embedding_length", U32, a.hidden),
        kv("llama.block_count", U32, a.layers),
        kv("llama.feed_forward_length", U32, a.intermediate),
        kv("llama.attention.head_count", U32, a.heads),
        kv("llama.attention.head_count_kv", U32, a.kv_heads),
        kv("llama.rope.dimension_count", U32, head_dim),
        kv("llama.rope.freq_base", F32, 10000.0),
        kv("llama.attention.layer_norm_rms_epsilon", F32, 1e-5),
        kv("llama.vocab_size", U32, len(tokens)),
        kv("tokenizer.ggml.model", STRING, "gpt2"),
        kv("tokenizer.ggml.pre", STRING, "gpt-2"),
        kv("tokenizer.ggml.tokens", ARRAY, (STRING, tokens)),
        kv("tokenizer.ggml.token_type", ARRAY, (I32, [1] * eos + [3])),
        kv("tokenizer.ggml.merges", ARRAY, (STRING, merges)),
        kv("tokenizer.ggml.bos_token_id", U32, eos),
        kv("tokenizer.ggml.eos_token_id", U32, eos),
    ]
    # (name, dims innermost first, random f16 or f32 ones)
    tensors = [("token_embd.weight", (a.hidden, len(tokens)), True)]
    for i in range(a.layers):
        b = f"blk.{i}."
        tensors += [
            (b + "attn_norm.weight", (a.hidden,), False),
            (b + "attn_q.weight", (a.hidden, a.hidden), True),
            (b + "attn_k.weight", (a.hidden, kv_dim), True),
            (b + "attn_v.weight", (a.hidden, kv_dim), True),
            (b + "attn_output.weight", (a.hidden, a.hidden), True),
            (b + "ffn_norm.weight", (a.hidden,), False),
            (b + "ffn_gate.weight", (a.hidden, a.intermediate), True),
            (b + "ffn_up.weight", (a.hidden, a.intermediate), True),
            (b + "ffn_down.weight", (a.intermediate, a.hidden), True),
        ]
    tensors += [("output_norm.weight", (a.hidden,), False), ("output.weight", (a.hidden, len(tokens)), True)]
    infos, offset = [], 0
    for name, dims, rand in tensors:
        n = 1
        for d in dims:
            n *= d
        infos.append(s(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
                     + struct.pack("<IQ", GGML_F16 if rand else GGML_F32, offset))
        offset += -(-(n * (2 if rand else 4)) // ALIGN) * ALIGN
    rng = random.Random(a.seed)
    with open(a.out, "wb") as f:
        head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)) + b"".join(meta) + b"".join(infos)
        f.write(head + b"\0" * (-len(head) % ALIGN))
        for name, dims, rand in tensors:
            n = 1
            for d in dims:
                n *= d
            data = random_f16(n, rng) if rand else struct.pack("<f", 1.0) * n
            f.write(data + b"\0" * (-len(data) % ALIGN))
    print(a.out)


if __name__ == "__main__":
    main()
