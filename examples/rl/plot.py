#!/usr/bin/env python3
"""Plots a grpo.py log: reward, training-inference mismatch and step-time split over steps.

Usage: plot.py OUT/log.jsonl [PNG]   (default: plot.png next to the log)
"""

import json
import os
import sys


def plot(log_path, png=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(l) for l in open(log_path) if l.strip()]
    png = png or os.path.join(os.path.dirname(os.path.abspath(log_path)), "plot.png")
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(1, 4, figsize=(20, 4.2))

    reward = [r["reward_mean"] for r in rows]
    ax[0].plot(steps, reward, "o-", ms=3, label="mean reward")
    k = 5
    if len(reward) >= k:
        avg = [sum(reward[i - k + 1:i + 1]) / k for i in range(k - 1, len(reward))]
        ax[0].plot(steps[k - 1:], avg, "-", lw=2, label=f"{k}-step average")
    ax[0].set_xlabel("step")
    ax[0].set_title("reward (batch trained on at each step)")
    ax[0].legend()

    ax[1].semilogy(steps, [max(r["logprob_absdiff_max"], 1e-12) for r in rows], "o-", ms=3, label="max |Δ logprob|")
    ax[1].semilogy(steps, [max(r["logprob_absdiff_mean"], 1e-12) for r in rows], "o-", ms=3, label="mean |Δ logprob|")
    ax[1].semilogy(steps, [max(abs(r["kl_ferry_trainer_k3"]), 1e-16) for r in rows], "o-", ms=3, label="KL(ferry‖trainer), k3")
    ax[1].axhline(1e-4, color="grey", ls="--", lw=1, label="1e-4")
    ax[1].set_xlabel("step")
    ax[1].set_title("ferry vs trainer on the generating weights")
    ax[1].legend(fontsize=8)

    parts = [("train_s", "train"), ("wait_for_rollouts_s", "wait for rollouts"),
             ("pause_s", "pause"), ("push_s", "weight push"), ("resume_s", "resume")]
    bottom = [0.0] * len(rows)
    for key, label in parts:
        vals = [r[key] + (r["sync_wait_s"] if key == "pause_s" else 0.0) for r in rows]
        ax[2].bar(steps, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    share = sum(r["weight_sync_share"] for r in rows) / len(rows)
    ax[2].set_xlabel("step")
    ax[2].set_ylabel("seconds")
    ax[2].set_title(f"step time (weight sync {share:.1%} on average)")
    ax[2].legend(fontsize=8)

    # Off-policy tokens: from an older version than the one trained (stale), the rollouts that
    # spanned an update, and the importance ratios their tokens are weighted by.
    n_tok = [max(1, r["n_tokens"]) for r in rows]
    ax[3].bar(steps, [r["stale_tokens"] / n for r, n in zip(rows, n_tok)], color="tab:grey", alpha=0.5,
              label="stale tokens (share)")
    ax[3].bar(steps, [r["rollouts_spanning_update"] / max(1, r["n_rollouts"]) for r in rows], color="tab:red",
              alpha=0.7, label="rollouts spanning an update (share)")
    ax[3].set_ylim(0, 1.6)  # room for the legend above the bars
    ax[3].set_yticks([0, 0.25, 0.5, 0.75, 1.0])
    ax[3].set_xlabel("step")
    ax[3].set_title("off-policy tokens and their importance ratios")
    tw = ax[3].twinx()
    st = [r for r in rows if r["stale_tokens"]]
    if st:
        xs = [r["step"] for r in st]
        tw.semilogy(xs, [r["stale_ratio_max"] for r in st], "v-", ms=3, color="tab:blue", label="ratio max")
        tw.semilogy(xs, [r["stale_ratio_mean"] for r in st], "o-", ms=3, color="tab:green", label="ratio mean")
        tw.semilogy(xs, [r["stale_ratio_min"] for r in st], "^-", ms=3, color="tab:purple", label="ratio min")
        lo = min(r["stale_ratio_min"] for r in st)
        hi = max(r["stale_ratio_max"] for r in st)
        tw.set_ylim(lo / 3, hi * 3 * (hi / lo) ** 0.6)  # lines below the legend
    tw.set_ylabel("π_current / π_generating")
    h1, l1 = ax[3].get_legend_handles_labels()
    h2, l2 = tw.get_legend_handles_labels()
    ax[3].legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left", ncol=2)

    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    print(plot(sys.argv[1], sys.argv[2] if len(sys.argv) == 3 else None))
