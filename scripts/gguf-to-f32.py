#!/usr/bin/env python3
"""Writes an F32 copy of a GGUF file (every quantized tensor dequantized, metadata kept), so
llama.cpp can be measured at the precision ferry computes in (ferry dequantizes to f32 at load).

    pip install gguf numpy
    python3 scripts/gguf-to-f32.py IN.gguf OUT.gguf
"""
import sys

import numpy as np
from gguf import GGUFReader, GGUFWriter, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize


def main(src, dst):
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == "general.file_type":
            writer.add_uint32(name, 0)  # ALL_F32
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            writer.add_array(name, field.contents())
        else:
            writer.add_key_value(name, field.contents(), vtype)
    for t in reader.tensors:
        data = dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = tuple(reversed([int(d) for d in t.shape]))
        writer.add_tensor(t.name, data.reshape(shape), raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
