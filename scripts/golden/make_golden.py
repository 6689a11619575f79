#!/usr/bin/env python3
"""Golden data for ferry's model tests, computed by Hugging Face `transformers` on CPU in f32.

Writes two small JSON files (committed under crates/ferry-model/tests/golden/):

* tiny.json -- for the `tiny` model folder written by `ferry make-model tiny --out DIR`:
  token ids that the Python `tokenizers` library gives for a few texts with the folder's
  tokenizer.json, and the logits of every position (full vocabulary) for three prompts, from
  `LlamaForCausalLM.from_pretrained(DIR, dtype=float32)` in eval mode.
* smollm2.json -- for SmolLM2-135M-Instruct (Q4_1 GGUF, as fetched by scripts/fetch-model.sh),
  loaded by transformers' own GGUF path (`gguf_file=`, which dequantizes with the `gguf`
  package and undoes llama.cpp's q/k permutation itself):
  the config, token ids for a few texts (one rendered with the chat template), per-tensor stats
  of some dequantized tensors (sum, sum of squares, first 8 values of a few rows), and the
  top-20 logits of the last position for two prompts.

Tokenizer note: transformers (5.x) builds the GGUF tokenizer with a plain GPT-2 byte-level
split and ignores `tokenizer.ggml.pre = "smollm"`; SmolLM2's own tokenizer.json (and
llama.cpp's `smollm` pre-tokenizer) also splits digits one by one. The reference therefore puts
`Digits(individual_digits=True)` in front, as SmolLM2's tokenizer.json does.

Run through scripts/golden/make-golden.sh, which builds ferry, writes the tiny folder and
fetches the model first. Needs: torch, transformers, gguf, numpy, accelerate, tokenizers.
"""
import argparse
import json
import os
import sys

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, pre_tokenizers

# Values are stored with 8 significant digits: far below the test tolerances (1e-4).
DIGITS = 8

TINY_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld, 1234 + 56 = 1290 ✓ 日本語",
    "<|im_start|>user\nWhat is the answer?<|im_end|>\n<|im_start|>assistant\n",
]

SMOL_TEXTS = [
    "The capital of France is",
    "In 2024, 17 people wrote 3.14159 lines of code.",
    "Ünïcödé tèxt — with dashes, 日本語 and emoji 🚀!",
]

SMOL_CHAT = [{"role": "user", "content": "What is the capital of France?"}]

SMOL_TENSORS = [
    "model.embed_tokens.weight",  # Q8_0 in the file
    "model.layers.0.self_attn.q_proj.weight",  # Q4_1, un-permuted over 9 heads
    "model.layers.0.self_attn.k_proj.weight",  # Q4_1, un-permuted over 3 KV heads
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.29.self_attn.o_proj.weight",
    "model.layers.0.input_layernorm.weight",  # F32
    "model.norm.weight",
]
# Rows whose first 8 values are stored: 0, 1 and 32 move (or not) under the q/k un-permute
# (head_dim 64: HF row 1 is GGUF row 2, HF row 32 is GGUF row 1).
SMOL_ROWS = [0, 1, 31, 32, 63, 64]


def r(x):
    return float(f"{float(x):.{DIGITS}g}")


def tiny_golden(tiny_dir):
    tok = Tokenizer.from_file(os.path.join(tiny_dir, "tokenizer.json"))
    texts = [{"text": t, "ids": tok.encode(t, add_special_tokens=False).ids} for t in TINY_TEXTS]
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    model.eval()
    prompts = []
    # The texts' ids, and one single-token prompt (the first step of a decode).
    for ids in [texts[0]["ids"], texts[2]["ids"], [72]]:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        prompts.append({"ids": ids, "logits": [[r(v) for v in row] for row in logits.tolist()]})
    return {
        "about": "tiny model: logits of every position, transformers LlamaForCausalLM, f32, CPU",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "tolerance_abs": 1e-4,
        "texts": texts,
        "prompts": prompts,
    }


def smol_tokenizer(model_dir, gguf_file):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_file)
    # See the module docstring: SmolLM2 splits digits individually.
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return tok


def tensor_stats(t):
    t = t.detach().to(torch.float64)
    stats = {
        "shape": list(t.shape),
        "sum": float(t.sum()),
        "sum_sq": float((t * t).sum()),
    }
    if t.dim() == 1:
        stats["rows"] = {"0": [r(v) for v in t[:8].tolist()]}
    else:
        stats["rows"] = {str(i): [r(v) for v in t[i, :8].tolist()] for i in SMOL_ROWS if i < t.shape[0]}
    return stats


def smol_golden(gguf_path):
    model_dir, gguf_file = os.path.split(os.path.abspath(gguf_path))
    tok = smol_tokenizer(model_dir, gguf_file)
    chat = tok.apply_chat_template(SMOL_CHAT, tokenize=False, add_generation_prompt=True)
    texts = [{"text": t, "ids": tok(t, add_special_tokens=False)["input_ids"]} for t in SMOL_TEXTS + [chat]]

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf_file, dtype=torch.float32)
    model.eval()
    cfg = model.config
    state = model.state_dict()
    tensors = {name: tensor_stats(state[name]) for name in SMOL_TENSORS}
    prompts = []
    for ids in [texts[0]["ids"], texts[-1]["ids"]]:
        with torch.no_grad():
            last = model(torch.tensor([ids])).logits[0, -1]
        top = torch.topk(last, 20)
        prompts.append(
            {
                "ids": ids,
                "top_ids": top.indices.tolist(),
                "top_logits": [r(v) for v in top.values.tolist()],
            }
        )
    return {
        "about": "SmolLM2-135M-Instruct Q4_1 GGUF via transformers' GGUF loader, f32, CPU",
        "model_file": gguf_file,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "tolerance_logits_abs": 2e-3,
        "tolerance_tensor_sum_rel": 1e-5,
        "config": {
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": (cfg.rope_parameters or {}).get("rope_theta")
            if hasattr(cfg, "rope_parameters")
            else cfg.rope_theta,
            "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_id,
        },
        "chat_messages": SMOL_CHAT,
        "texts": texts,
        "tensors": tensors,
        "prompts": prompts,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny-dir", required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", required=True, help="folder for tiny.json and smollm2.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    os.makedirs(args.out, exist_ok=True)
    for name, data in [("tiny.json", tiny_golden(args.tiny_dir)), ("smollm2.json", smol_golden(args.gguf))]:
        path = os.path.join(args.out, name)
        with open(path, "w") as f:
            json.dump(data, f, separators=(",", ":"), ensure_ascii=False)
            f.write("\n")
        print(f"wrote {path} ({os.path.getsize(path)} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
