#!/usr/bin/env python3
"""GRPO against ferry: PyTorch trains on CPU, `ferry serve --enable-admin-api` generates.

Each step:
  1. submit the next batch (prompts x group samples: `n`, temperature 1, `logprobs`,
     `return_token_ids`, streamed) -- it generates while this step trains, so it is one
     step off-policy and the weight update below lands in the middle of it;
  2. on the previous batch: rewards, group-normalised advantages, the trainer's logprobs of
     the sampled tokens under the weights that generated each of them (the current weights,
     or the previous ones, kept for that), a PPO-clipped policy-gradient step with AdamW;
  3. `POST /pause?mode=keep&clear_cache=true` -> a bucketed upload of the whole state dict
     (`POST /weight_uploads`, buckets of safetensors bytes under Hugging Face names, each
     serialised as it is sent, then `.../commit` as `step-N`; `--push one-body`: one
     `POST /update_weights?weight_version=step-N`) -> `POST /resume`.

clear_cache=true: requests frozen by the pause drop their KV and recompute it with the new
weights after the resume, so a token generated after the update was computed from the new
weights over its whole prefix -- what the trainer recomputes. (With clear_cache=false it would
attend to KV computed with the old weights, which no single set of weights reproduces.) A
clearing pause is a whole reset: with `--kv-offload-bytes` it empties the offload tier too. A
bare `POST /reset_prefix_cache` would not (vLLM's default, `reset_external=false`: its answer
says `"cleared": ["device"]`); pass `reset_external=true` where a reset must leave nothing.

Per step it writes a JSONL line (reward, training-inference mismatch, importance ratios,
rollouts that spanned the update, timings) to OUT/log.jsonl and, at the end, OUT/plot.png.
`--check` turns the measurements into pass/fail checks with cargo-style output (CI).
"""

import argparse
import copy
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ferry_client import Ferry, FerryError  # noqa: E402
from llama_mini import LlamaMini, folder_tensor_names, safetensors_bytes  # noqa: E402

INITIAL = "initial"  # label of ferry's version before the first push (read from /weight_info)

# ---------------------------------------------------------------------------------------
# Tasks: a prompt, and a reward computed from the completion.


# A short system prompt (SmolLM2's template adds a longer one when there is none): fewer
# prompt tokens for the trainer to run through.
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


class Addition:
    """Two-digit addition; reward 1 if the first number in the answer is the sum."""

    name = "addition"

    def __init__(self, rng):
        self.rng = rng

    def sample(self):
        a, b = self.rng.randint(10, 99), self.rng.randint(10, 99)
        msg = f"What is {a} + {b}? Answer with just the number."
        return {"messages": [SYSTEM, {"role": "user", "content": msg}], "answer": a + b}

    def reward(self, item, text, token_ids):
        m = re.search(r"-?\d+", text.replace(",", ""))
        return 1.0 if m and int(m.group()) == item["answer"] else 0.0


class WordCount:
    """Write about a topic in exactly N words; reward 1 / (1 + |words - N|): 1 when exact, and
    dense, so every group ranks its samples (the model starts far too wordy)."""

    name = "wordcount"
    TOPICS = ["the sea", "a cat", "rain", "coffee", "the moon", "trains", "music", "a forest",
              "winter", "bread", "a city", "the sun", "books", "a river", "friends", "snow"]

    def __init__(self, rng):
        self.rng = rng

    def sample(self):
        n, topic = self.rng.randint(3, 8), self.rng.choice(self.TOPICS)
        msg = f"Write a sentence about {topic} using exactly {n} words."
        return {"messages": [SYSTEM, {"role": "user", "content": msg}], "answer": n}

    def reward(self, item, text, token_ids):
        return 1.0 / (1.0 + abs(len(text.split()) - item["answer"]))


class EvenTokens:
    """For the random-weight tiny model (unreadable text): the share of even token ids."""

    name = "even-tokens"

    def __init__(self, rng):
        self.rng = rng

    def sample(self):
        return {"text": "rollout %d" % self.rng.randint(0, 10**6), "answer": None}

    def reward(self, item, text, token_ids):
        return sum(t % 2 == 0 for t in token_ids) / max(1, len(token_ids))


TASKS = {t.name: t for t in (Addition, WordCount, EvenTokens)}

# ---------------------------------------------------------------------------------------
# Trainer models.


def load_model(kind, model_dir):
    if kind == "hf":
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    else:
        m = LlamaMini.from_folder(model_dir)
    m.eval()  # no dropout; gradients still flow
    return m


def hidden_and_head(model, ids, mask):
    """The last hidden states [batch, time, hidden], and the function that makes logits of them
    (applied only where logprobs are needed: the vocabulary projection is a fifth of a small
    model's compute)."""
    if isinstance(model, LlamaMini):
        return model.hidden(ids), model.head
    out = model.model(input_ids=ids, attention_mask=mask)
    return out.last_hidden_state, model.lm_head


def token_logprobs(model, seqs, micro_batch, grad=False):
    """For each (prompt_ids, output_ids), the f32 logprobs of output_ids under `model`, in
    micro-batches: yields [(index, logprobs tensor)], with a graph when grad is set."""
    for b in range(0, len(seqs), micro_batch):
        idx = list(range(b, min(len(seqs), b + micro_batch)))
        full = [seqs[i][0] + seqs[i][1] for i in idx]
        T = max(len(f) for f in full)
        ids = torch.zeros((len(idx), T), dtype=torch.long)
        mask = torch.zeros((len(idx), T), dtype=torch.long)
        for j, f in enumerate(full):
            ids[j, :len(f)] = torch.tensor(f)
            mask[j, :len(f)] = 1
        with torch.set_grad_enabled(grad):
            hidden, head = hidden_and_head(model, ids, mask)
            out = []
            for j, i in enumerate(idx):
                p, o = len(seqs[i][0]), len(seqs[i][1])
                logits = head(hidden[j, p - 1:p - 1 + o]).float()
                lp = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(seqs[i][1])[:, None])[:, 0]
                out.append((i, lp))
        yield out


# ---------------------------------------------------------------------------------------
# The loop.


class Checks:
    """Cargo-style pass/fail lines, so scripts/test.sh counts them with cargo's tests."""

    def __init__(self):
        self.failures = {}
        self.names = []

    def add(self, name, ok, detail=""):
        if name not in self.names:
            self.names.append(name)
        if not ok:
            self.failures.setdefault(name, detail)

    def report(self):
        for n in self.names:
            if n in self.failures:
                print(f"test rl_example::{n} ... FAILED\n    {self.failures[n]}", flush=True)
            else:
                print(f"test rl_example::{n} ... ok", flush=True)
        f = len(self.failures)
        p = len(self.names) - f
        print(f"\ntest result: {'ok' if f == 0 else 'FAILED'}. {p} passed; {f} failed; 0 ignored (rl example)")
        return f == 0


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start_server(args):
    port = free_port()
    log = open(os.path.join(args.out, "ferry-serve.log"), "w")
    cmd = [args.ferry, "serve", "--model", args.serve_model or args.model_dir, "--host", "127.0.0.1",
           "--port", str(port), "--enable-admin-api", "--seed", str(args.seed)] + args.serve_arg
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    ferry = Ferry(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 300
    while not ferry.healthy():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise FerryError(f"ferry serve did not come up; see {log.name}")
        time.sleep(0.2)
    return proc, ferry


def stop_server(proc):
    if proc and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def prompt_ids_of(ferry, item):
    if "messages" in item:
        return ferry.tokenize_chat(item["messages"])
    return ferry.tokenize(item["text"])


def run(args):
    os.makedirs(args.out, exist_ok=True)
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    task = TASKS[args.task](rng)
    checks = Checks()

    t0 = time.perf_counter()
    model = load_model(args.trainer, args.model_dir)
    prev = copy.deepcopy(model)  # the weights of the previous version
    for p in prev.parameters():
        p.requires_grad_(False)
    push_names = folder_tensor_names(args.model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    print(f"trainer: {args.trainer}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"loaded in {time.perf_counter() - t0:.1f}s", flush=True)

    proc = None
    if args.url:
        ferry = Ferry(args.url)
    else:
        proc, ferry = start_server(args)
    try:
        return loop(args, rng, task, model, prev, push_names, opt, ferry, checks)
    finally:
        stop_server(proc)


def loop(args, rng, task, model, prev, push_names, opt, ferry, checks):
    log_path = os.path.join(args.out, "log.jsonl")
    logf = open(log_path, "w")
    gen0 = ferry.metric("ferry_generation_tokens_total")
    fin0 = ferry.metric("ferry_requests_finished_total")
    version = {"cur": ferry.weight_version(), "prev": None}
    extra = {"ignore_eos": True} if args.ignore_eos else {}

    def submit_batch():
        out = []
        for _ in range(args.prompts):
            item = task.sample()
            out.append(ferry.submit(item, prompt_ids_of(ferry, item), args.group, args.max_tokens,
                                    version["cur"], extra))
        return out

    def wait_batch(batch):
        for r in batch:
            if not r.done.wait(args.request_timeout):
                raise FerryError("a rollout did not finish in time")
        return max(r.t_done for r in batch) - min(r.t_submit for r in batch)

    all_rollouts = []
    batch = submit_batch()
    wait_batch(batch)
    all_rollouts += batch
    history = []
    for step in range(1, args.steps + 1):
        t_step = time.perf_counter()
        nxt = submit_batch() if step < args.steps and not args.pause_mid_rollout else []
        all_rollouts += nxt

        # -- rewards and advantages --------------------------------------------------------
        seqs, meta = [], []
        rewards = []
        n_lost = 0
        for r in batch:
            if r.error:
                n_lost += 1
                checks.add("no_request_lost", False, f"request failed: {r.error}")
                continue
            rs = [task.reward(r.item, c.text, c.token_ids) for c in r.choices]
            rewards += rs
            mu = sum(rs) / len(rs)
            sd = math.sqrt(sum((x - mu) ** 2 for x in rs) / len(rs))
            for c, rw in zip(r.choices, rs):
                if not c.token_ids:
                    continue
                seqs.append((list(r.prompt_ids), list(c.token_ids)))
                meta.append({"choice": c, "adv": (rw - mu) / (sd + 1e-4), "versions": c.token_versions()})

        # -- trainer logprobs under the generating weights, and the update ------------------
        t_train = time.perf_counter()
        stale = [i for i, m in enumerate(meta) if any(v != version["cur"] for v in m["versions"])]
        prev_lp = {}
        if stale:
            for out in token_logprobs(prev, [seqs[i] for i in stale], args.micro_batch):
                for j, lp in out:
                    prev_lp[stale[j]] = lp
        n_tokens = sum(len(s[1]) for s in seqs)
        opt.zero_grad()
        diffs, ratios_mismatch, ratio_stale, k3, stale_vs_cur = [], [], [], [], []
        loss_total = 0.0
        for out in token_logprobs(model, seqs, args.micro_batch, grad=True):
            loss = 0.0
            for i, lp in out:
                m = meta[i]
                cur_mask = torch.tensor([v == version["cur"] for v in m["versions"]])
                behav = lp.detach().clone()
                if i in prev_lp:
                    behav = torch.where(cur_mask, behav, prev_lp[i])
                ferry_lp = torch.tensor(m["choice"].logprobs, dtype=torch.float32)
                d = (ferry_lp - behav)
                diffs.append(d.abs())
                r_mm = torch.exp(behav - ferry_lp)  # trainer / ferry on the same weights
                ratios_mismatch.append(r_mm)
                x = (behav - ferry_lp).double()  # float64: the k3 terms are ~x^2/2, far below f32's epsilon
                k3.append(torch.expm1(x) - x)
                rho = torch.exp(lp - behav)  # importance ratio: current / generating weights
                if (~cur_mask).any():
                    ratio_stale.append(rho.detach()[~cur_mask])
                    stale_vs_cur.append((ferry_lp - lp.detach())[~cur_mask].abs())
                a = m["adv"]
                obj = torch.minimum(rho * a, torch.clamp(rho, 1 - args.clip, 1 + args.clip) * a)
                loss = loss - obj.sum() / n_tokens
            loss.backward()
            loss_total += float(loss.detach())
        with torch.no_grad():
            prev.load_state_dict(model.state_dict())  # keep this version for the next step
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        train_s = time.perf_counter() - t_train

        # -- the weight sync: pause(keep) -> push -> resume ---------------------------------
        new_version = f"step-{step}"
        if args.pause_mid_rollout and step < args.steps:
            # (tests) make the update land inside the next batch whatever the speeds: submit it
            # only now, pause as soon as one of its rollouts has tokens, and check, paused and
            # with every generated token received, that some choice is really mid-generation.
            # When the batch outran the pause (a fast engine, a slow client), resume and try
            # again with one more batch: the check holds by construction, not by timing.
            nxt = []
            for attempt in range(1, args.span_attempts + 1):
                more = submit_batch()
                nxt += more
                all_rollouts += more
                deadline = time.monotonic() + args.request_timeout
                while time.monotonic() < deadline and not any(
                        r.done.is_set() or any(c.token_ids for c in r.choices) for r in more):
                    time.sleep(0.0005)
                t = time.perf_counter()
                ferry.pause(clear_cache=True)
                pause_s = time.perf_counter() - t
                ferry.wait_received(ferry.metric("ferry_generation_tokens_total") - gen0)
                if any(c.token_ids and c.finish_reason is None for r in nxt for c in r.choices):
                    break
                if attempt == args.span_attempts:
                    checks.add("update_lands_mid_rollout", False,
                               f"step {step}: every batch of {attempt} finished before its pause")
                    break
                ferry.resume()
        else:
            t = time.perf_counter()
            ferry.pause(clear_cache=True)
            pause_s = time.perf_counter() - t
            ferry.wait_received(ferry.metric("ferry_generation_tokens_total") - gen0)
        n_frozen = ferry.mark_update(new_version)
        sync_wait_s = time.perf_counter() - t - pause_s
        t = time.perf_counter()
        state = {k: v for k, v in model.state_dict().items() if k in push_names}
        if args.push == "one-body":
            blob = safetensors_bytes(state)
            serialize_s = time.perf_counter() - t
            reply = ferry.update_weights(blob, new_version)
        else:
            # Buckets serialised as they are sent: no serialising step of its own.
            serialize_s = 0.0
            reply = ferry.upload_weights(state, new_version, bucket_bytes=args.bucket_bytes)
        push_s = time.perf_counter() - t
        t = time.perf_counter()
        ferry.resume()
        resume_s = time.perf_counter() - t
        checks.add("every_push_complete_and_versioned", reply.get("complete") and reply.get("weight_version") == new_version,
                   f"step {step}: {reply}")
        version["prev"], version["cur"] = version["cur"], new_version

        # -- wait for the next batch (generating since the start of this step) --------------
        t = time.perf_counter()
        gen_s = wait_batch(nxt) if nxt else 0.0
        wait_s = time.perf_counter() - t
        step_s = time.perf_counter() - t_step

        # -- measurements --------------------------------------------------------------------
        d = torch.cat(diffs) if diffs else torch.zeros(1)
        rm = torch.cat(ratios_mismatch) if ratios_mismatch else torch.ones(1)
        rs = torch.cat(ratio_stale) if ratio_stale else torch.ones(0)
        spanning = sum(1 for m in meta if len(set(m["versions"])) > 1)
        rec = {
            "step": step,
            "weight_version": new_version,
            "reward_mean": sum(rewards) / max(1, len(rewards)),
            "n_rollouts": len(seqs),
            "n_tokens": n_tokens,
            "loss": loss_total,
            "logprob_absdiff_max": float(d.max()),
            "logprob_absdiff_mean": float(d.mean()),
            "kl_ferry_trainer_k3": float(torch.cat(k3).mean()) if k3 else 0.0,
            "mismatch_ratio_min": float(rm.min()),
            "mismatch_ratio_max": float(rm.max()),
            "rollouts_spanning_update": spanning,
            "stale_tokens": int(rs.numel()),
            "stale_ratio_mean": float(rs.mean()) if rs.numel() else None,
            "stale_ratio_min": float(rs.min()) if rs.numel() else None,
            "stale_ratio_max": float(rs.max()) if rs.numel() else None,
            "stale_absdiff_vs_new_weights_max": float(torch.cat(stale_vs_cur).max()) if stale_vs_cur else None,
            "frozen_at_update": n_frozen,
            "generate_s": gen_s,
            "wait_for_rollouts_s": wait_s,
            "train_s": train_s,
            "pause_s": pause_s,
            "sync_wait_s": sync_wait_s,
            "serialize_s": serialize_s,
            "push_s": push_s,
            "push_bytes": sum(v.numel() * 4 for v in state.values()),
            "push": args.push,
            "resume_s": resume_s,
            "step_s": step_s,
            "weight_sync_share": (pause_s + sync_wait_s + push_s + resume_s) / step_s,
        }
        history.append(rec)
        logf.write(json.dumps(rec) + "\n")
        logf.flush()
        print(f"step {step:3d}  reward {rec['reward_mean']:.3f}  |dlogp| max {rec['logprob_absdiff_max']:.2e} "
              f"mean {rec['logprob_absdiff_mean']:.2e}  spanning {spanning}/{len(seqs)} stale tok {rec['stale_tokens']}  "
              f"step {step_s:.1f}s (gen {gen_s:.1f} train {train_s:.1f} push {push_s:.2f} pause+resume "
              f"{pause_s + resume_s:.3f})  sync share {rec['weight_sync_share']:.1%}", flush=True)

        # -- the checks (recorded always, enforced with --check) ----------------------------
        checks.add("logprobs_match_generating_weights", rec["logprob_absdiff_max"] <= args.tolerance,
                   f"step {step}: max |ferry - trainer| = {rec['logprob_absdiff_max']:.3e} > {args.tolerance}")
        for m in meta:
            c = m["choice"]
            want = [v for v in c.versions_in_order()]
            checks.add("weight_versions_list_token_versions_in_order", c.weight_versions == want,
                       f"step {step}: reported {c.weight_versions}, tokens came from {want}")
            checks.add("logprob_per_token", len(c.logprobs) == len(c.token_ids),
                       f"{len(c.logprobs)} logprobs for {len(c.token_ids)} tokens")
        batch = nxt

    # -- no request lost ----------------------------------------------------------------
    for r in all_rollouts:
        ok = r.error is None and all(c.finish_reason in ("stop", "length") for c in r.choices)
        checks.add("no_request_lost", ok, f"{r.error} {[c.finish_reason for c in r.choices]}")
        if ok and r.usage:
            checks.add("no_request_lost", r.usage["completion_tokens"] == sum(len(c.token_ids) for c in r.choices),
                       f"usage {r.usage} vs tokens received")
        checks.add("prompt_token_ids_echoed", r.prompt_ids_reported in (None, r.prompt_ids),
                   f"{r.prompt_ids_reported} != {r.prompt_ids}")
    generated = ferry.metric("ferry_generation_tokens_total") - gen0
    finished = ferry.metric("ferry_requests_finished_total") - fin0
    n_choices = sum(len(r.choices) for r in all_rollouts)
    checks.add("no_request_lost", ferry.received_tokens == generated,
               f"client received {ferry.received_tokens} tokens, engine generated {generated}")
    checks.add("no_request_lost", finished == n_choices, f"engine finished {finished}, client sent {n_choices} choices")
    checks.add("some_rollouts_span_an_update", any(h["rollouts_spanning_update"] for h in history),
               "no rollout spanned a weight update, so nothing exercised the mixed-version path")
    # The check above means something only if the versions are told apart: the stale tokens'
    # logprobs under the newer weights must differ from ferry's by far more than the tolerance.
    sv = [h["stale_absdiff_vs_new_weights_max"] for h in history if h["stale_absdiff_vs_new_weights_max"] is not None]
    checks.add("stale_tokens_differ_under_newer_weights", bool(sv) and max(sv) > 100 * args.tolerance,
               f"max |ferry - newer weights| on stale tokens: {sv}")
    checks.add("final_weight_version_reported", ferry.weight_version() == version["cur"],
               f"/weight_info {ferry.weight_version()} != {version['cur']}")

    summary = {
        "steps": len(history),
        "reward_first": history[0]["reward_mean"] if history else None,
        "reward_last": history[-1]["reward_mean"] if history else None,
        "logprob_absdiff_max": max(h["logprob_absdiff_max"] for h in history) if history else None,
        "weight_sync_share_mean": sum(h["weight_sync_share"] for h in history) / max(1, len(history)),
        "rollouts_spanning_update": sum(h["rollouts_spanning_update"] for h in history),
        "requests": len(all_rollouts),
        "tokens_generated": generated,
    }
    print("summary: " + json.dumps(summary), flush=True)
    if not args.no_plot:
        try:
            from plot import plot

            png = plot(log_path)
            print(f"plot: {png}", flush=True)
        except ImportError as e:
            print(f"plot: skipped ({e})", flush=True)
    print(f"log: {log_path}", flush=True)
    if args.check:
        return checks.report()
    return True


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True, help="Hugging Face folder (f32) the trainer loads and ferry serves")
    ap.add_argument("--serve-model", help="what ferry serves instead of --model-dir (e.g. tiny)")
    ap.add_argument("--ferry", default=os.path.join(root, "target", "release", "ferry"), help="the ferry binary")
    ap.add_argument("--url", help="use a running `ferry serve --enable-admin-api` instead of starting one")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra argument for ferry serve (repeatable)")
    ap.add_argument("--trainer", choices=["hf", "mini"], default=None,
                    help="hf: transformers; mini: examples/rl/llama_mini.py (default: hf if installed)")
    ap.add_argument("--task", choices=sorted(TASKS), default="wordcount")
    ap.add_argument("--push", choices=["bucketed", "one-body"], default="bucketed",
                    help="weight sync: a bucketed upload (/weight_uploads) or one safetensors body")
    ap.add_argument("--bucket-bytes", type=int, default=64 << 20, help="bucket size of a bucketed upload")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step (groups)")
    ap.add_argument("--group", type=int, default=4, help="samples per prompt (n)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--ignore-eos", action="store_true", help="every sample max-tokens long")
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tolerance", type=float, default=1e-4, help="max |ferry - trainer| logprob for --check")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--request-timeout", type=float, default=900)
    ap.add_argument("--out", default=os.path.join(here, "runs", "latest"))
    ap.add_argument("--check", action="store_true", help="print cargo-style checks; exit 1 if any fails")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--pause-mid-rollout", action="store_true",
                    help="(tests) submit the next batch after training, not before, and pause "
                         "once one of its rollouts has started: every update lands mid-rollout")
    ap.add_argument("--span-attempts", type=int, default=50,
                    help="(tests, --pause-mid-rollout) batches to try before giving up on an "
                         "update that lands mid-rollout")
    args = ap.parse_args()
    if args.trainer is None:
        try:
            import transformers  # noqa: F401

            args.trainer = "hf"
        except ImportError:
            args.trainer = "mini"
    if args.threads:
        torch.set_num_threads(args.threads)
    if not os.path.exists(args.ferry) and not args.url:
        found = shutil.which("ferry")
        if not found:
            sys.exit(f"no ferry binary at {args.ferry} (cargo build --release -p ferry)")
        args.ferry = found
    try:
        ok = run(args)
    except Exception:
        traceback.print_exc()
        if args.check:
            print("test rl_example::run ... FAILED")
            print("\ntest result: FAILED. 0 passed; 1 failed; 0 ignored (rl example)")
        sys.exit(1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
