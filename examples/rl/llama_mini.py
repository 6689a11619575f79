"""A short Llama-family forward in PyTorch, and safetensors reading and writing without the
`safetensors` package.

The trainer of examples/rl/grpo.py uses Hugging Face transformers when it is installed
(`--trainer hf`). This module is the other trainer (`--trainer mini`): the same f32 math in ~100
lines, enough for Llama / SmolLM2 / Qwen2 folders without rope scaling. It runs on old torch
versions (Debian's 1.13, which CI installs), so the CI test needs no transformers and no
multi-GB PyPI wheels. Parameter names are the Hugging Face ones, so its state dict is what
`POST /update_weights` takes.
"""

import json
import math
import os
import struct

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": None}


def read_safetensors(path):
    """{name: float32 torch tensor} from one .safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        b, e = meta["data_offsets"]
        raw = data[b:e]
        if meta["dtype"] == "BF16":
            u16 = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
            arr = u16.view(np.float32)
        else:
            arr = np.frombuffer(raw, dtype=_DTYPES[meta["dtype"]]).astype(np.float32)
        out[name] = torch.from_numpy(arr.reshape(meta["shape"]).copy())
    return out


def folder_tensor_names(model_dir):
    """The tensor names a model folder holds (all its .safetensors files)."""
    names = set()
    for fn in sorted(os.listdir(model_dir)):
        if fn.endswith(".safetensors"):
            with open(os.path.join(model_dir, fn), "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                names.update(k for k in json.loads(f.read(n)) if k != "__metadata__")
    return names


def safetensors_bytes(tensors):
    """Serialises {name: tensor} as one safetensors blob of F32 tensors."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        a = tensors[name].detach().to(torch.float32).contiguous().cpu().numpy()
        raw = a.tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return b"".join([struct.pack("<Q", len(h)), h] + blobs)


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, self.nh, self.nkv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
        self.hd = c.get("head_dim") or h // self.nh
        bias = bool(c.get("attention_bias", False))
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=bias)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)

    def forward(self, x, cos, sin, mask):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(self.hd) + mask
        y = torch.softmax(att, dim=-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.nh * self.hd))


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # Hugging Face's rotate_half
    return x * cos + rot * sin


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        eps = c.get("rms_norm_eps", 1e-5)
        self.input_layernorm = RMSNorm(c["hidden_size"], eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Inner(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c.get("rms_norm_eps", 1e-5))


class LlamaMini(nn.Module):
    """`model.*` and `lm_head.weight` as in Hugging Face's LlamaForCausalLM."""

    def __init__(self, c):
        super().__init__()
        if c.get("rope_scaling"):
            raise ValueError("llama_mini: rope_scaling is not implemented; use --trainer hf")
        self.config = c
        self.model = Inner(c)
        self.tied = bool(c.get("tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        theta = float(c.get("rope_theta", 10000.0))
        self.register_buffer(
            "inv_freq", 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd), persistent=False
        )

    @classmethod
    def from_folder(cls, model_dir):
        with open(os.path.join(model_dir, "config.json")) as f:
            c = json.load(f)
        m = cls(c)
        sd = {}
        for fn in sorted(os.listdir(model_dir)):
            if fn.endswith(".safetensors"):
                sd.update(read_safetensors(os.path.join(model_dir, fn)))
        missing, unexpected = m.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not (m.tied and k == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"llama_mini: missing {missing}, unexpected {unexpected}")
        return m

    def forward(self, input_ids):
        """Logits [batch, time, vocab] in f32; positions 0.. (right padding is harmless)."""
        return self.head(self.hidden(input_ids))

    def head(self, x):
        w = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return x @ w.t()

    def hidden(self, input_ids):
        """The final norm's output [batch, time, hidden]."""
        t = input_ids.shape[1]
        pos = torch.arange(t, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        mask = torch.full((t, t), float("-inf")).triu(1)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask)
        return self.model.norm(x)
