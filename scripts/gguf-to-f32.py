#!/usr/bin/env python3
"""Writes a copy of a GGUF file with every tensor in F32 (dequantized), or with every matrix
in Q8_0 (`--type q8_0`: dequantized, then quantized by gguf-py's reference Q8_0; vectors stay
F32), metadata kept: the F32 and Q8_0 files of the llama.cpp comparison
(`scripts/bench-llamacpp.py`).

    pip install gguf numpy
    python3 scripts/gguf-to-f32.py IN.gguf OUT.gguf [--type f32|q8_0]
"""
import sys

import numpy as np
from gguf import GGUFReader, GGUFWriter, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize, quantize


def main(src, dst, out_type="f32"):
    q8 = out_type == "q8_0"
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == "general.file_type":
            writer.add_uint32(name, 7 if q8 else 0)  # MOSTLY_Q8_0 or ALL_F32
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            writer.add_array(name, field.contents())
        else:
            writer.add_key_value(name, field.contents(), vtype)
    for t in reader.tensors:
        data = dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = tuple(reversed([int(d) for d in t.shape]))
        data = data.reshape(shape)
        if q8 and len(shape) == 2 and shape[-1] % 32 == 0:
            blocks = quantize(data, GGMLQuantizationType.Q8_0)
            writer.add_tensor(t.name, blocks, raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(t.name, data, raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    args = sys.argv[1:]
    out_type = "f32"
    if "--type" in args:
        i = args.index("--type")
        out_type = args[i + 1].lower()
        del args[i:i + 2]
    if out_type not in ("f32", "q8_0") or len(args) != 2:
        sys.exit("usage: gguf-to-f32.py IN.gguf OUT.gguf [--type f32|q8_0]")
    main(args[0], args[1], out_type)
