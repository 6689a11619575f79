#!/usr/bin/env python3
"""Golden data for ferry's mixture-of-experts (MoE) models, computed by Hugging Face `transformers` on CPU in f32.

Writes, deterministically (fixed torch seeds, no downloads):

* crates/ferry-model/tests/fixtures/moe/<case>/ -- a tiny random-weight model per case: config.json,
  model.safetensors (float32, one shard) and generation_config.json, as `save_pretrained` writes them
  (no tokenizer). Cases:
    qwen3_moe         Qwen3MoeForCausalLM, norm_topk_prob=True, head_dim 12 (not hidden/heads = 8), untied lm_head.
    qwen3_moe_fused   the same weights as qwen3_moe, written in the fused in-memory layout (see below).
    qwen3_moe_sparse  Qwen3MoeForCausalLM, norm_topk_prob=False, top-k 3, decoder_sparse_step=2 and
                      mlp_only_layers=[2]: only layer 1 is MoE, layers 0 and 2 are dense MLPs (intermediate 24);
                      tie_word_embeddings=True (no lm_head.weight in the file).
    qwen2_moe         Qwen2MoeForCausalLM, shared expert (intermediate 24) with sigmoid shared_expert_gate,
                      norm_topk_prob=False, q/k/v biases (qkv_bias, always on by default).
    olmoe             OlmoeForCausalLM, q/k RMSNorm over the whole projection, norm_topk_prob=False.
    mixtral           MixtralForCausalLM, sliding_window None, 8 local experts, top-2 (always renormalised).
  Every case: vocab 128, hidden 32, 4 attention heads, 2 KV heads, 3 layers, 8 experts, top-k 2 (3 in
  qwen3_moe_sparse), expert intermediate 16, max_position_embeddings 256, rms_norm_eps 1e-6, bos 1, eos 2.
  (hidden 32 and expert intermediate 16 rather than 64/32: with 64/32 one folder is ~0.9 MB in f32 and the
  seven folders would be ~6 MB; these sizes keep each folder near 250 KB.)
* crates/ferry-model/tests/golden/moe.json -- per case (see `case_golden`): the config.json dict, the names and
  shapes of the tensors in the saved file (`tensors`) and of `model.state_dict()` in memory (`state_dict`), the
  `layout`, the MoE layer indices, and for three fixed prompts the logits of every position (full vocabulary),
  the experts each position is routed to in each MoE layer, their routing weights and the router margins; and
  the greedy continuation of prompt 0. Floats carry 8 significant digits.

Weights. transformers' own init (normal, std 0.02) gives near-equal router logits everywhere, so routing would
be decided by rounding noise. After building each model, every parameter is re-drawn from a fixed
`torch.Generator` (sorted by name): router (`*.mlp.gate.weight`, the TopKRouter) normal std 4/sqrt(hidden);
token embeddings normal std 0.5 (0.3 when tied to lm_head, else greedy keeps repeating the last token); an
untied lm_head normal std 3/sqrt(hidden); other matrices normal std 1/sqrt(fan_in) (the last dimension, also
for the 3-D fused expert tensors); RMSNorm weights 1 + 0.1*normal; biases 0.1*normal. The seed is the first of base, base+1000, ... for which no routing decision
of the three prompts is within MIN_ROUTER_MARGIN (2e-4 probability) of a tie, no greedy step is within
MIN_GREEDY_MARGIN (1e-2 logit) of one, and the greedy continuation holds no eos (2) and at least 3 distinct
tokens; it is recorded as `weight_seed`. The script prints logit and routing statistics so degenerate outputs
(one-hot or uniform softmax) show.

Layout (transformers 5.25). In memory every class holds the experts fused as 3-D parameters:
  model.layers.{l}.mlp.experts.gate_up_proj  [E, 2*I, H]  rows 0..I-1 are gate (w1), rows I..2I-1 are up (w3)
                                                         (forward: linear(x, gate_up_proj[e]).chunk(2) -> gate, up)
  model.layers.{l}.mlp.experts.down_proj     [E, H, I]
  model.layers.{l}.mlp.gate.weight           [E, H]      (the router; Mixtral too, renamed from block_sparse_moe)
`save_pretrained` (save_original_format=True, the default) runs the class's conversion mapping in reverse
(transformers/conversion_mapping.py, core_model_loading.revert_weight_conversion) and so writes the per-expert
hub layout:
  Qwen3-MoE / Qwen2-MoE / OLMoE: model.layers.{l}.mlp.experts.{e}.{gate,up}_proj.weight [I, H],
                                 model.layers.{l}.mlp.experts.{e}.down_proj.weight [H, I],
                                 model.layers.{l}.mlp.gate.weight [E, H]
  Mixtral: model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight (gate) [I, H], .w3.weight (up) [I, H],
           .w2.weight (down) [H, I], model.layers.{l}.block_sparse_moe.gate.weight [E, H]
The script asserts that gate_up_proj[e, :I] == gate_proj/w1 and gate_up_proj[e, I:] == up_proj/w3 of the saved
file. qwen3_moe_fused is written with save_pretrained(save_original_format=False): the in-memory names and the
3-D tensors. Every folder is loaded back with from_pretrained and the golden data are computed from that
reloaded model; they are checked to equal the in-memory model's (and qwen3_moe_fused's to equal qwen3_moe's):
same routing and greedy ids, logits within 1e-5 (not bit-equal: the mmapped tensors' alignment changes the
CPU kernels' rounding by ~1e-6).
Note config.json: Qwen3MoeConfig writes the expert count as "num_local_experts" (its attribute_map sends
num_experts there), while hub Qwen3/Qwen2-MoE configs and Qwen2MoeConfig/OlmoeConfig use "num_experts";
Mixtral uses "num_local_experts".

Routing. All four routers (Qwen3MoeTopKRouter, Qwen2MoeTopKRouter, OlmoeTopKRouter, MixtralTopKRouter) do:
logits = hidden @ W.T; probs = softmax(logits) in f32; (values, ids) = torch.topk(probs, k) (descending
probability); if norm_topk_prob (always, for Mixtral) values /= values.sum(); the block's output is
sum_k values[k] * expert_{ids[k]}(x). `routed_experts` are the router modules' own `ids`, captured with forward
hooks on each TopKRouter (its forward returns (router_logits, router_scores, router_indices)); the router
logits that `output_router_logits=True` returns are checked to equal the hooked ones. Ties: torch.topk gives
no index order for equal values (on CPU it does NOT pick the lowest index first: topk([1,2,2,0,2], 2) -> ids
[2, 4]), so tests should skip picks whose `router_margin` is tiny. `router_margin[p][m][j]` is
probs[pick j] - probs[next best after pick j] of the full softmax (before renormalisation), for j < k:
the last entry (j = k-1) is the margin that decides the selected set; earlier ones decide the order.

Forward: attn_implementation="eager" and experts_implementation="eager" (the python loop over experts);
the default sdpa/grouped_mm path is checked to agree within 1e-4.
Greedy: an explicit argmax loop over full-prefix forwards (no KV cache), checked against
generate(do_sample=False, max_new_tokens=8) (which uses the KV cache); the chosen weights give no eos in it.

moe.json schema:
  {"about", "transformers", "torch", "tolerance_logits_abs": 1e-4, "fixtures": "crates/ferry-model/tests/fixtures/moe",
   "cases": {<case>: {
     "model_class": "Qwen3MoeForCausalLM" | ..., "layout": "per_expert" | "fused", "weight_seed": int,
     "config": {config.json}, "files": [file names in the folder],
     "tensors": {name: shape} (model.safetensors), "state_dict": {name: shape} (in memory, always fused),
     "moe_layers": [layer indices that are MoE], "top_k": int,
     "prompts": [{"ids": [T], "logits": [T][vocab],
                  "routed_experts": [T][len(moe_layers)][top_k] expert ids, best first,
                  "routed_weights": [T][len(moe_layers)][top_k] the weights the block applies (after any renorm),
                  "router_margin": [T][len(moe_layers)][top_k] (see Routing)}] x 3 (lengths 12, 7, 1),
     "greedy": {"prompt": 0, "ids": [8 new tokens], "logit_margin": [8] top-1 minus top-2 logit per step}}}}

Run through scripts/golden/make-moe-golden.sh. Needs torch, transformers (5.25), safetensors, numpy.
"""
import argparse
import json
import os
import shutil
import sys

import torch
import transformers
from safetensors import safe_open

# Values are stored with 8 significant digits: far below the test tolerances.
DIGITS = 8

PROMPTS = [
    [3, 17, 42, 99, 5, 63, 127, 8, 31, 77, 120, 54],
    [1, 64, 9, 88, 23, 101, 46],
    [72],
]
GREEDY_NEW = 8

COMMON = dict(
    vocab_size=128,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=3,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
)
NUM_EXPERTS = 8
EXPERT_I = 16
DENSE_I = 24
# Weight seeds are tried until every routing decision of the three prompts (the k-th vs (k+1)-th softmax
# probability) and every greedy step (top-1 vs top-2 logit) is at least this far from a tie, and the greedy
# continuation holds no eos and at least 3 distinct tokens.
MIN_ROUTER_MARGIN = 2e-4
MIN_GREEDY_MARGIN = 1e-2
MAX_SEED_TRIES = 50

# (case, model class, config class, config kwargs, weight seed)
CASES = [
    (
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(
            num_experts=NUM_EXPERTS,
            num_experts_per_tok=2,
            moe_intermediate_size=EXPERT_I,
            intermediate_size=DENSE_I,
            norm_topk_prob=True,
            head_dim=12,
            tie_word_embeddings=False,
        ),
        101,
    ),
    (
        "qwen3_moe_sparse",
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(
            num_experts=NUM_EXPERTS,
            num_experts_per_tok=3,
            moe_intermediate_size=EXPERT_I,
            intermediate_size=DENSE_I,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            mlp_only_layers=[2],
            tie_word_embeddings=True,
        ),
        102,
    ),
    (
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        dict(
            num_experts=NUM_EXPERTS,
            num_experts_per_tok=2,
            moe_intermediate_size=EXPERT_I,
            intermediate_size=DENSE_I,
            shared_expert_intermediate_size=DENSE_I,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
        103,
    ),
    (
        "olmoe",
        "OlmoeForCausalLM",
        "OlmoeConfig",
        dict(
            num_experts=NUM_EXPERTS,
            num_experts_per_tok=2,
            intermediate_size=EXPERT_I,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
        104,
    ),
    (
        "mixtral",
        "MixtralForCausalLM",
        "MixtralConfig",
        dict(
            num_local_experts=NUM_EXPERTS,
            num_experts_per_tok=2,
            intermediate_size=EXPERT_I,
            sliding_window=None,
            tie_word_embeddings=False,
        ),
        105,
    ),
]
# Extra folder: the same weights as `qwen3_moe`, written in the fused (in-memory) layout.
FUSED_CASE = ("qwen3_moe_fused", "qwen3_moe")


def r(x):
    return float(f"{float(x):.{DIGITS}g}")


def routers(model):
    """(layer index, TopKRouter module) of every MoE layer."""
    out = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and type(gate).__name__.endswith("TopKRouter"):
            out.append((i, gate))
    return out


def reinit(model, seed, hidden):
    g = torch.Generator().manual_seed(seed)
    # Tied: a smaller table, else the last token's own embedding dominates the logits and greedy repeats it.
    embed_std = 0.3 if model.config.tie_word_embeddings else 0.5
    router_params = {id(m.weight) for _, m in routers(model)}
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if id(p) in router_params:
                v = noise * (4.0 / hidden**0.5)
            elif name.endswith("norm.weight"):
                v = 1.0 + 0.1 * noise
            elif name.endswith(".bias"):
                v = 0.1 * noise
            elif name.endswith("embed_tokens.weight"):
                v = embed_std * noise
            elif name.endswith("lm_head.weight"):
                v = noise * (3.0 / hidden**0.5)
            else:
                assert p.dim() in (2, 3), name
                v = noise / p.shape[-1] ** 0.5
            p.copy_(v)


def build(model_cls, config_cls, kwargs, seed, impl):
    config = getattr(transformers, config_cls)(**COMMON, **kwargs)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)._from_config(
        config, attn_implementation=impl[0], experts_implementation=impl[1], dtype=torch.float32
    )
    reinit(model, seed, config.hidden_size)
    model.eval()
    return model


def min_margins(golden):
    """Smallest k-th router margin over the prompts, and smallest greedy top-1/top-2 logit gap."""
    router = min(m[-1] for p in golden["prompts"] for pos in p["router_margin"] for m in pos)
    return router, min(golden["greedy"]["logit_margin"])


def pick_weights(model_cls, config_cls, kwargs, base_seed):
    """The first of base_seed, base_seed + 1000, ... whose routing and greedy picks are not near-ties."""
    for attempt in range(MAX_SEED_TRIES):
        seed = base_seed + 1000 * attempt
        model = build(model_cls, config_cls, kwargs, seed, ("eager", "eager"))
        prompts = [prompt_golden(model, ids) for ids in PROMPTS]
        cont, cont_margin = greedy(model, PROMPTS[0])
        router, logit = min_margins({"prompts": prompts, "greedy": {"logit_margin": cont_margin}})
        eos = COMMON["eos_token_id"] in cont
        varied = len(set(cont)) >= 3
        if router >= MIN_ROUTER_MARGIN and logit >= MIN_GREEDY_MARGIN and not eos and varied:
            return model, seed
        print(
            f"{model_cls} seed {seed}: router margin {router:.2e}, greedy margin {logit:.2e}, eos {eos}, "
            f"greedy {cont}; next",
            file=sys.stderr,
        )
    raise SystemExit(f"no seed for {model_cls} in {MAX_SEED_TRIES} tries")


def file_tensors(path):
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def check_fused_vs_saved(model, saved):
    """gate_up_proj[e, :I] is the saved gate (gate_proj / w1), [e, I:] the up (up_proj / w3)."""
    state = model.state_dict()
    mixtral = type(model).__name__.startswith("Mixtral")
    for li, _ in routers(model):
        gu = state[f"model.layers.{li}.mlp.experts.gate_up_proj"]
        down = state[f"model.layers.{li}.mlp.experts.down_proj"]
        i = gu.shape[1] // 2
        for e in range(gu.shape[0]):
            if mixtral:
                pre = f"model.layers.{li}.block_sparse_moe.experts.{e}."
                g, u, d = saved[pre + "w1.weight"], saved[pre + "w3.weight"], saved[pre + "w2.weight"]
            else:
                pre = f"model.layers.{li}.mlp.experts.{e}."
                g, u, d = (saved[pre + n + ".weight"] for n in ("gate_proj", "up_proj", "down_proj"))
            assert torch.equal(gu[e, :i], g) and torch.equal(gu[e, i:], u) and torch.equal(down[e], d), (li, e)


def run(model, ids):
    """Logits [T, V] and, per MoE layer, the router's (logits, scores, indices), captured by hooks."""
    captured = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: captured.append(out)) for _, m in routers(model)]
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_router_logits=True)
    finally:
        for h in hooks:
            h.remove()
    assert len(captured) == len(out.router_logits)
    for (lg, _, _), olg in zip(captured, out.router_logits):
        assert torch.equal(lg, olg)
    return out.logits[0], captured


def greedy(model, ids):
    seq = list(ids)
    margins = []
    for _ in range(GREEDY_NEW):
        with torch.no_grad():
            last = model(torch.tensor([seq])).logits[0, -1]
        top = torch.topk(last, 2).values
        margins.append(r(top[0] - top[1]))
        seq.append(int(torch.argmax(last)))
    with torch.no_grad():
        gen = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=GREEDY_NEW,
            pad_token_id=0,
        )[0].tolist()
    # generate stops at eos (2); the explicit loop does not.
    assert gen == seq[: len(gen)] and (len(gen) == len(seq) or gen[-1] == COMMON["eos_token_id"]), (gen, seq)
    return seq[len(ids) :], margins


def prompt_golden(model, ids):
    logits, captured = run(model, ids)
    routed, weights, margins = [], [], []
    for p in range(len(ids)):
        routed.append([])
        weights.append([])
        margins.append([])
        for lg, scores, idx in captured:
            probs = torch.softmax(lg[p].float(), dim=-1)
            k = idx.shape[-1]
            order = torch.sort(probs, descending=True).values
            picks = idx[p].tolist()
            # The router's picks are the top-k by probability, best first.
            assert torch.equal(probs[idx[p]], order[:k]), (p, picks)
            routed[-1].append(picks)
            weights[-1].append([r(v) for v in scores[p].tolist()])
            margins[-1].append([r(order[j] - order[j + 1]) for j in range(k)])
    return {
        "ids": ids,
        "logits": [[r(v) for v in row] for row in logits.tolist()],
        "routed_experts": routed,
        "routed_weights": weights,
        "router_margin": margins,
    }


def case_golden(model, folder, layout):
    path = os.path.join(folder, "model.safetensors")
    saved = file_tensors(path)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    prompts = [prompt_golden(model, ids) for ids in PROMPTS]
    cont, cont_margin = greedy(model, PROMPTS[0])
    return {
        "model_class": type(model).__name__,
        "layout": layout,
        "config": config,
        "files": sorted(os.listdir(folder)),
        "tensors": {k: list(v.shape) for k, v in sorted(saved.items())},
        "state_dict": {k: list(v.shape) for k, v in model.state_dict().items()},
        "moe_layers": [i for i, _ in routers(model)],
        "top_k": model.config.num_experts_per_tok,
        "prompts": prompts,
        "greedy": {"prompt": 0, "ids": cont, "logit_margin": cont_margin},
    }


def stats(name, golden):
    logits = torch.tensor([row for p in golden["prompts"] for row in p["logits"]])
    probs = torch.softmax(logits, dim=-1)
    pmax = probs.max(dim=-1).values
    last_margins = [m[-1] for p in golden["prompts"] for pos in p["router_margin"] for m in pos]
    experts = sorted({e for p in golden["prompts"] for pos in p["routed_experts"] for m in pos for e in m})
    print(
        f"{name}: logits std {logits.std():.3f}, max softmax prob min/mean/max "
        f"{pmax.min():.3f}/{pmax.mean():.3f}/{pmax.max():.3f}; router k-th margin min {min(last_margins):.2e}, "
        f"median {sorted(last_margins)[len(last_margins) // 2]:.3f}; experts used {experts}; "
        f"greedy {golden['greedy']['ids']}",
        file=sys.stderr,
    )


def same_outputs(a, b, tol=0.0):
    for pa, pb in zip(a["prompts"], b["prompts"]):
        assert pa["routed_experts"] == pb["routed_experts"]
        diff = (torch.tensor(pa["logits"]) - torch.tensor(pb["logits"])).abs().max().item()
        assert diff <= tol, diff
    assert a["greedy"]["ids"] == b["greedy"]["ids"]


def folder_size(folder):
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", required=True, help="folder for the <case>/ model folders")
    ap.add_argument("--out", required=True, help="folder for moe.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.fixtures, exist_ok=True)
    eager = ("eager", "eager")
    cases = {}
    for name, model_cls, config_cls, kwargs, base_seed in CASES:
        model, seed = pick_weights(model_cls, config_cls, kwargs, base_seed)
        folder = os.path.join(args.fixtures, name)
        shutil.rmtree(folder, ignore_errors=True)
        model.save_pretrained(folder)
        check_fused_vs_saved(model, file_tensors(os.path.join(folder, "model.safetensors")))
        built = case_golden(model, folder, "per_expert")
        # The golden data come from the folder as transformers loads it back.
        loaded = getattr(transformers, model_cls).from_pretrained(
            folder, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
        )
        loaded.eval()
        golden = case_golden(loaded, folder, "per_expert")
        # Not bit-equal: the loaded tensors are mmapped at other alignments, so CPU kernels round differently.
        same_outputs(built, golden, tol=1e-5)
        # The default implementations (sdpa attention, grouped_mm experts) agree.
        default = getattr(transformers, model_cls).from_pretrained(folder, dtype=torch.float32)
        default.eval()
        same_outputs(golden, case_golden(default, folder, "per_expert"), tol=1e-4)
        golden["weight_seed"] = seed
        cases[name] = golden
        stats(name, golden)

        if name == FUSED_CASE[1]:
            fused_name = FUSED_CASE[0]
            fused_folder = os.path.join(args.fixtures, fused_name)
            shutil.rmtree(fused_folder, ignore_errors=True)
            loaded.save_pretrained(fused_folder, save_original_format=False)
            reloaded = getattr(transformers, model_cls).from_pretrained(
                fused_folder, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
            )
            reloaded.eval()
            fused = case_golden(reloaded, fused_folder, "fused")
            assert any(k.endswith("experts.gate_up_proj") for k in fused["tensors"])
            same_outputs(golden, fused, tol=1e-5)
            fused["weight_seed"] = seed
            cases[fused_name] = fused
            stats(fused_name, fused)

    total = 0
    for name in cases:
        folder = os.path.join(args.fixtures, name)
        size = folder_size(folder)
        total += size
        print(f"{folder}: {size} bytes", file=sys.stderr)
    data = {
        "about": "tiny random MoE models (fixtures/moe/<case>/), transformers *ForCausalLM, f32, CPU, eager",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "tolerance_logits_abs": 1e-4,
        "fixtures": "crates/ferry-model/tests/fixtures/moe",
        "cases": cases,
    }
    path = os.path.join(args.out, "moe.json")
    with open(path, "w") as f:
        json.dump(data, f, separators=(",", ":"), ensure_ascii=False)
        f.write("\n")
    print(f"wrote {path} ({os.path.getsize(path)} bytes); fixtures {total} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
