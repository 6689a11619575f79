#!/usr/bin/env python3
"""Writes a Qwen3-MoE Hugging Face folder of F32 safetensors (what `ferry make-model moe --arch
qwen3_moe` writes) as a `qwen3moe` GGUF that both ferry and llama.cpp load: the same weights,
byte for byte, in F32 (experts stacked into llama.cpp's `ffn_{gate,up,down}_exps`), and the
folder's byte-level BPE tokenizer as a `gpt2` vocabulary with its merges and special tokens.
The input for `llama-quantize in.gguf out.gguf Q4_1`, so an MoE file can be compared with
llama.cpp without a download. Standard library only.

    ferry make-model moe --arch qwen3_moe --size bench --out DIR
    python3 scripts/moe-folder-to-gguf.py DIR OUT.gguf
"""
import argparse
import importlib.util
import json
import struct
from pathlib import Path

# The GGUF writing helpers (value types, `s`, `kv`, alignment) of random-llama-gguf.py.
_spec = importlib.util.spec_from_file_location(
    "random_llama_gguf", Path(__file__).with_name("random-llama-gguf.py")
)
_gguf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gguf)
U32, I32, F32, BOOL, STRING, ARRAY = (_gguf.U32, _gguf.I32, _gguf.F32, _gguf.BOOL, _gguf.STRING, _gguf.ARRAY)
GGML_F32, ALIGN, s, kv = _gguf.GGML_F32, _gguf.ALIGN, _gguf.s, _gguf.kv


class Safetensors:
    def __init__(self, path):
        self.f = open(path, "rb")
        n = struct.unpack("<Q", self.f.read(8))[0]
        self.header = json.loads(self.f.read(n))
        self.header.pop("__metadata__", None)
        self.base = 8 + n

    def shape(self, name):
        t = self.header[name]
        if t["dtype"] != "F32":
            raise SystemExit(f"{name} is {t['dtype']}; this script copies F32 folders only")
        return t["shape"]

    def read(self, name):
        self.shape(name)
        a, b = self.header[name]["data_offsets"]
        self.f.seek(self.base + a)
        return self.f.read(b - a)


def tokenizer_meta(folder, cfg):
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    model = tok["model"]
    if model["type"] != "BPE":
        raise SystemExit("only a BPE tokenizer.json is supported")
    vocab = dict(model["vocab"])
    special = set()
    for t in tok.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
        if t.get("special"):
            special.add(t["id"])
    n = max(cfg["vocab_size"], max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [5] * n  # unused
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = 3 if i in special else 1  # control / normal
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    ids = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    meta = [
        kv("tokenizer.ggml.model", STRING, "gpt2"),
        kv("tokenizer.ggml.pre", STRING, "gpt-2"),
        kv("tokenizer.ggml.tokens", ARRAY, (STRING, tokens)),
        kv("tokenizer.ggml.token_type", ARRAY, (I32, types)),
        kv("tokenizer.ggml.merges", ARRAY, (STRING, merges)),
        kv("tokenizer.ggml.add_bos_token", BOOL, bool(tok_cfg.get("add_bos_token", False))),
    ]
    for key, field in (("bos_token_id", "bos_token"), ("eos_token_id", "eos_token")):
        if tok_cfg.get(field) in ids:
            meta.append(kv(f"tokenizer.ggml.{key}", U32, ids[tok_cfg[field]]))
    if tok_cfg.get("chat_template"):
        meta.append(kv("tokenizer.chat_template", STRING, tok_cfg["chat_template"]))
    return meta


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("out")
    a = ap.parse_args()
    folder = Path(a.folder)
    cfg = json.loads((folder / "config.json").read_text())
    if cfg.get("model_type") != "qwen3_moe":
        raise SystemExit(f"model_type {cfg.get('model_type')!r}: only qwen3_moe is written")
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise SystemExit("dense layers between the MoE ones are not written")
    st = Safetensors(folder / "model.safetensors")
    arch = "qwen3moe"
    layers, n_exp = cfg["num_hidden_layers"], cfg["num_experts"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    meta = [
        kv("general.architecture", STRING, arch),
        kv("general.name", STRING, folder.name),
        kv("general.file_type", U32, 0),
        kv(f"{arch}.context_length", U32, cfg["max_position_embeddings"]),
        kv(f"{arch}.embedding_length", U32, cfg["hidden_size"]),
        kv(f"{arch}.block_count", U32, layers),
        kv(f"{arch}.feed_forward_length", U32, cfg["intermediate_size"]),
        kv(f"{arch}.attention.head_count", U32, cfg["num_attention_heads"]),
        kv(f"{arch}.attention.head_count_kv", U32, cfg["num_key_value_heads"]),
        kv(f"{arch}.attention.key_length", U32, head_dim),
        kv(f"{arch}.attention.value_length", U32, head_dim),
        kv(f"{arch}.rope.freq_base", F32, float(cfg["rope_theta"])),
        kv(f"{arch}.attention.layer_norm_rms_epsilon", F32, float(cfg["rms_norm_eps"])),
        kv(f"{arch}.expert_count", U32, n_exp),
        kv(f"{arch}.expert_used_count", U32, cfg["num_experts_per_tok"]),
        kv(f"{arch}.expert_feed_forward_length", U32, cfg["moe_intermediate_size"]),
    ] + tokenizer_meta(folder, cfg)
    # (GGUF name, HF names whose data is concatenated, GGUF dims innermost first)
    tensors = []

    def plain(gguf, hf):
        tensors.append((gguf, [hf], tuple(reversed(st.shape(hf)))))

    plain("token_embd.weight", "model.embed_tokens.weight")
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        plain(b + "attn_norm.weight", p + "input_layernorm.weight")
        plain(b + "attn_q.weight", p + "self_attn.q_proj.weight")
        plain(b + "attn_k.weight", p + "self_attn.k_proj.weight")
        plain(b + "attn_v.weight", p + "self_attn.v_proj.weight")
        plain(b + "attn_output.weight", p + "self_attn.o_proj.weight")
        plain(b + "attn_q_norm.weight", p + "self_attn.q_norm.weight")
        plain(b + "attn_k_norm.weight", p + "self_attn.k_norm.weight")
        plain(b + "ffn_norm.weight", p + "post_attention_layernorm.weight")
        plain(b + "ffn_gate_inp.weight", p + "mlp.gate.weight")
        for gguf, hf in (("ffn_gate_exps", "gate_proj"), ("ffn_up_exps", "up_proj"), ("ffn_down_exps", "down_proj")):
            names = [f"{p}mlp.experts.{e}.{hf}.weight" for e in range(n_exp)]
            tensors.append((f"{b}{gguf}.weight", names, tuple(reversed(st.shape(names[0]))) + (n_exp,)))
    plain("output_norm.weight", "model.norm.weight")
    if cfg.get("tie_word_embeddings"):
        pass  # llama.cpp falls back to token_embd without output.weight
    else:
        plain("output.weight", "lm_head.weight")

    infos, offset = [], 0
    for name, _, dims in tensors:
        n = 4
        for d in dims:
            n *= d
        infos.append(s(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
                     + struct.pack("<IQ", GGML_F32, offset))
        offset += -(-n // ALIGN) * ALIGN
    with open(a.out, "wb") as f:
        head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)) + b"".join(meta) + b"".join(infos)
        f.write(head + b"\0" * (-len(head) % ALIGN))
        for _, names, _ in tensors:
            size = 0
            for hf in names:
                data = st.read(hf)
                f.write(data)
                size += len(data)
            f.write(b"\0" * (-size % ALIGN))
    print(a.out)


if __name__ == "__main__":
    main()
