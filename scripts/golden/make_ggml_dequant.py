#!/usr/bin/env python3
"""Reference dequantization of the GGML block types ferry reads through an f32 scratch.

Writes crates/ferry-model/tests/golden/ggml_dequant.json: for each of Q5_0, Q5_1, Q4_K and
Q6_K, a few blocks of seeded random bytes (the f16 scales drawn finite, the rest any byte)
and the f32 values (as u32 bits) that the `gguf` package's `gguf.quants.dequantize` gives
for them. ferry's `load::gguf::dequantize` must give the same bits
(tests/load_gguf.rs: `k_quant_and_q5_dequantization_matches_the_gguf_package`).

Needs: gguf, numpy (`pip install gguf`).
"""
import json
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

# (type, block bytes, offsets of f16 scales in a block, blocks)
TYPES = [
    (T.Q5_0, 22, [0], 6),
    (T.Q5_1, 24, [0, 2], 6),
    (T.Q4_K, 144, [0, 2], 3),
    (T.Q6_K, 210, [208], 3),
]


def main(out_path):
    rng = np.random.default_rng(40)
    out = {"about": "gguf.quants.dequantize of seeded random blocks (scripts/golden/make_ggml_dequant.py)"}
    for ty, block_bytes, scales, n_blocks in TYPES:
        raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
        for b in range(n_blocks):
            for at in scales:
                # A finite f16 of moderate size, sign either way (the dmin of Q4_K too).
                v = np.float16(rng.uniform(-2.0, 2.0) * 2.0 ** rng.integers(-12, 2))
                raw[b, at:at + 2] = np.frombuffer(v.tobytes(), dtype=np.uint8)
        values = dequantize(raw.reshape(-1), ty).astype(np.float32).reshape(-1)
        out[ty.name] = {
            "bytes": raw.reshape(-1).tobytes().hex(),
            "bits": [int(x) for x in values.view(np.uint32)],
        }
    with open(out_path, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "crates/ferry-model/tests/golden/ggml_dequant.json")
