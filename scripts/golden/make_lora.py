#!/usr/bin/env python3
"""Golden data for ferry's LoRA adapters, computed by Hugging Face `transformers` + `peft` on CPU in f32.

Writes, deterministically (fixed torch seeds, no downloads):

* crates/ferry-model/tests/fixtures/lora/<base>/ -- a tiny random-weight dense base model per architecture, as
  `save_pretrained` writes it (config.json, model.safetensors in float32, generation_config.json; no tokenizer):
    llama   LlamaForCausalLM, untied lm_head.
    qwen2   Qwen2ForCausalLM, q/k/v biases (always on), tied embeddings.
    qwen3   Qwen3ForCausalLM, per-head q/k RMSNorm, head_dim 12 (not hidden/heads = 8), tied embeddings.
  Every base: vocab 128, hidden 32, 4 attention heads, 2 KV heads, 2 layers, intermediate 48,
  max_position_embeddings 256, rms_norm_eps 1e-6, bos 1, eos 2.
* crates/ferry-model/tests/fixtures/lora/<case>/ -- a PEFT LoRA adapter of one base per case, as
  `PeftModel.save_pretrained` writes it (adapter_config.json, adapter_model.safetensors; the README.md model
  card it also writes is removed). Cases (see CASES): attention-only targets, "all-linear", rslora, and one with
  rank_pattern, alpha_pattern and layers_to_transform.
* crates/ferry-model/tests/golden/lora.json -- per case: the base folder, the adapter folder, and for three fixed
  prompts the log-softmax of the logits at every position (full vocabulary) of the base with the adapter
  (`PeftModel.from_pretrained(base, folder)`, eval); the greedy continuation (8 tokens) of prompt 0; and the
  largest difference the adapter makes to the base model's logits (so a test that ignored the adapter fails).
  Floats carry 8 significant digits.

Weights. Bases: every parameter re-drawn from a fixed `torch.Generator` (sorted by name): token embeddings
normal std 0.5, an untied lm_head normal std 3/sqrt(hidden), other matrices normal std 1/sqrt(fan_in), RMSNorm
weights 1 + 0.1*normal, biases 0.1*normal. Adapters: PEFT initialises lora_B to zero (the adapter would change
nothing), so after `get_peft_model` every lora_A is re-drawn normal std 1/sqrt(in) and every lora_B normal std
0.5/sqrt(r) from the case's generator. The seed is the first of base, base+1000, ... whose greedy continuation
has no step within MIN_GREEDY_MARGIN (1e-2 logit) of a tie, no eos (2), and at least 3 distinct tokens; it is
recorded as `weight_seed`.

Forward: attn_implementation="eager". Greedy: an explicit argmax loop over full-prefix forwards (no KV cache),
checked against generate(do_sample=False, max_new_tokens=8). The merged model (merge_and_unload) is checked to
give the same log-probabilities within 1e-4, which the Rust test does not rely on but which shows the adapter
is the plain W + scale * B @ A.

lora.json schema:
  {"about", "transformers", "torch", "peft", "tolerance_logprobs_abs": 1e-4,
   "fixtures": "crates/ferry-model/tests/fixtures/lora",
   "cases": {<case>: {"base": <base folder name>, "adapter": <case folder name>, "weight_seed": int,
     "adapter_config": {adapter_config.json}, "tensors": {name: shape} (adapter_model.safetensors),
     "prompts": [{"ids": [T], "logprobs": [T][vocab]}] x 3 (lengths 10, 6, 1),
     "greedy": {"prompt": 0, "ids": [8 new tokens], "logit_margin": [8] top-1 minus top-2 logit per step},
     "adapter_effect": max |logits(base + adapter) - logits(base)| over the prompts}}}

Run through scripts/golden/make-lora-golden.sh. Needs torch, transformers (5.25), peft (PEFT_VERSION), safetensors.
"""
import argparse
import json
import os
import shutil
import sys

import peft
import torch
import transformers
from safetensors import safe_open

PEFT_VERSION = "0.22.0"

# Values are stored with 8 significant digits: far below the test tolerances.
DIGITS = 8

PROMPTS = [
    [3, 17, 42, 99, 5, 63, 127, 8, 31, 77],
    [1, 64, 9, 88, 23, 101],
    [72],
]
GREEDY_NEW = 8
MIN_GREEDY_MARGIN = 1e-2
MAX_SEED_TRIES = 50

COMMON = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
)

# (base, model class, config class, config kwargs, weight seed)
BASES = [
    ("llama", "LlamaForCausalLM", "LlamaConfig", dict(tie_word_embeddings=False), 11),
    ("qwen2", "Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=True), 12),
    ("qwen3", "Qwen3ForCausalLM", "Qwen3Config", dict(tie_word_embeddings=True, head_dim=12), 13),
]

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]

# (case, base, LoraConfig kwargs, adapter seed)
CASES = [
    ("llama_attention", "llama", dict(r=8, lora_alpha=16, target_modules=ATTENTION), 21),
    ("llama_all_linear", "llama", dict(r=4, lora_alpha=8, target_modules="all-linear"), 22),
    ("qwen2_attention", "qwen2", dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]), 23),
    ("qwen2_all_linear_rslora", "qwen2", dict(r=8, lora_alpha=4, target_modules="all-linear", use_rslora=True), 24),
    ("qwen3_all_linear", "qwen3", dict(r=4, lora_alpha=16, target_modules="all-linear"), 25),
    (
        "qwen3_patterns",
        "qwen3",
        dict(
            r=4,
            lora_alpha=8,
            use_rslora=True,
            target_modules=ATTENTION + ["gate_proj", "up_proj", "down_proj"],
            rank_pattern={"o_proj": 2},
            alpha_pattern={"down_proj": 3},
            layers_to_transform=[1],
            layers_pattern="layers",
        ),
        26,
    ),
]


def r(x):
    return float(f"{float(x):.{DIGITS}g}")


def reinit_base(model, seed, hidden):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("norm.weight"):
                v = 1.0 + 0.1 * noise
            elif name.endswith(".bias"):
                v = 0.1 * noise
            elif name.endswith("embed_tokens.weight"):
                v = 0.5 * noise
            elif name.endswith("lm_head.weight"):
                v = noise * (3.0 / hidden**0.5)
            else:
                assert p.dim() == 2, name
                v = noise / p.shape[-1] ** 0.5
            p.copy_(v)


def reinit_adapter(model, seed):
    g = torch.Generator().manual_seed(seed)
    n = 0
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".lora_A." in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
                n += 1
            elif ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 / p.shape[1] ** 0.5))
                n += 1
    assert n > 0


def build_base(model_cls, config_cls, kwargs, seed):
    config = getattr(transformers, config_cls)(**COMMON, **kwargs)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)._from_config(config, attn_implementation="eager", dtype=torch.float32)
    reinit_base(model, seed, config.hidden_size)
    model.eval()
    return model


def load_base(model_cls, folder):
    model = getattr(transformers, model_cls).from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    return model


def logits_of(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def greedy(model, ids):
    seq = list(ids)
    margins = []
    for _ in range(GREEDY_NEW):
        last = logits_of(model, seq)[-1]
        top = torch.topk(last, 2).values
        margins.append(r(top[0] - top[1]))
        seq.append(int(torch.argmax(last)))
    with torch.no_grad():
        gen = model.generate(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=GREEDY_NEW,
            pad_token_id=0,
        )[0].tolist()
    assert gen == seq[: len(gen)] and (len(gen) == len(seq) or gen[-1] == COMMON["eos_token_id"]), (gen, seq)
    return seq[len(ids) :], margins


def lora_config(kwargs):
    return peft.LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, bias="none", **kwargs)


def pick_adapter(base_model_fn, kwargs, base_seed):
    """The first adapter seed whose greedy continuation is clear of ties, eos and repetition."""
    for attempt in range(MAX_SEED_TRIES):
        seed = base_seed + 1000 * attempt
        model = peft.get_peft_model(base_model_fn(), lora_config(kwargs))
        reinit_adapter(model, seed)
        model.eval()
        cont, margins = greedy(model, PROMPTS[0])
        if min(margins) >= MIN_GREEDY_MARGIN and COMMON["eos_token_id"] not in cont and len(set(cont)) >= 3:
            return model, seed
        print(f"adapter seed {seed}: greedy {cont}, margin {min(margins):.2e}; next", file=sys.stderr)
    raise SystemExit(f"no adapter seed in {MAX_SEED_TRIES} tries")


def file_tensors(path):
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def folder_size(folder):
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))


def main():
    if peft.__version__ != PEFT_VERSION:
        raise SystemExit(f"peft {peft.__version__} installed, this script is pinned to {PEFT_VERSION}")
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", required=True, help="folder for the <base>/ and <case>/ folders")
    ap.add_argument("--out", required=True, help="folder for lora.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.fixtures, exist_ok=True)

    base_classes = {}
    for name, model_cls, config_cls, kwargs, seed in BASES:
        folder = os.path.join(args.fixtures, name)
        shutil.rmtree(folder, ignore_errors=True)
        build_base(model_cls, config_cls, kwargs, seed).save_pretrained(folder)
        base_classes[name] = model_cls

    cases = {}
    for case, base, kwargs, base_seed in CASES:
        base_folder = os.path.join(args.fixtures, base)
        model_cls = base_classes[base]
        model, seed = pick_adapter(lambda: load_base(model_cls, base_folder), kwargs, base_seed)
        folder = os.path.join(args.fixtures, case)
        shutil.rmtree(folder, ignore_errors=True)
        model.save_pretrained(folder)
        readme = os.path.join(folder, "README.md")
        if os.path.exists(readme):
            os.remove(readme)

        # The golden data come from the folders as transformers and peft load them back.
        loaded = peft.PeftModel.from_pretrained(load_base(model_cls, base_folder), folder)
        loaded.eval()
        plain = load_base(model_cls, base_folder)
        prompts, effect = [], 0.0
        for ids in PROMPTS:
            logits = logits_of(loaded, ids)
            assert torch.allclose(logits, logits_of(model, ids), atol=1e-5, rtol=0)
            effect = max(effect, (logits - logits_of(plain, ids)).abs().max().item())
            logprobs = torch.log_softmax(logits.double(), dim=-1)
            prompts.append({"ids": ids, "logprobs": [[r(v) for v in row] for row in logprobs.tolist()]})
        cont, margins = greedy(loaded, PROMPTS[0])
        merged = peft.PeftModel.from_pretrained(load_base(model_cls, base_folder), folder).merge_and_unload()
        merged.eval()
        for ids, p in zip(PROMPTS, prompts):
            m = torch.log_softmax(logits_of(merged, ids).double(), dim=-1)
            diff = (m - torch.tensor(p["logprobs"], dtype=torch.float64)).abs().max().item()
            assert diff <= 1e-4, (case, diff)
        assert effect > 0.1, (case, effect)
        with open(os.path.join(folder, "adapter_config.json")) as f:
            adapter_config = json.load(f)
        saved = file_tensors(os.path.join(folder, "adapter_model.safetensors"))
        cases[case] = {
            "base": base,
            "adapter": case,
            "weight_seed": seed,
            "adapter_config": adapter_config,
            "tensors": {k: list(v.shape) for k, v in sorted(saved.items())},
            "prompts": prompts,
            "greedy": {"prompt": 0, "ids": cont, "logit_margin": margins},
            "adapter_effect": r(effect),
        }
        print(
            f"{case}: adapter effect {effect:.3f}, greedy {cont}, min margin {min(margins):.3f}, "
            f"{len(saved)} tensors, {folder_size(folder)} bytes",
            file=sys.stderr,
        )

    total = sum(folder_size(os.path.join(args.fixtures, d)) for d in os.listdir(args.fixtures)
                if os.path.isdir(os.path.join(args.fixtures, d)))
    data = {
        "about": "tiny random dense bases with random PEFT LoRA adapters (fixtures/lora/), f32, CPU, eager",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "peft": peft.__version__,
        "tolerance_logprobs_abs": 1e-4,
        "fixtures": "crates/ferry-model/tests/fixtures/lora",
        "cases": cases,
    }
    path = os.path.join(args.out, "lora.json")
    with open(path, "w") as f:
        json.dump(data, f, separators=(",", ":"), ensure_ascii=False)
        f.write("\n")
    print(f"wrote {path} ({os.path.getsize(path)} bytes); fixtures {total} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
