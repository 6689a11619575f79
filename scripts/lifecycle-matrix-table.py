#!/usr/bin/env python3
"""Turns the lifecycle matrix's results (FERRY_MATRIX_OUT, a JSON array written by
crates/ferry/tests/matrix) into the Markdown table of docs/lifecycle-matrix.md.

Usage: python3 scripts/lifecycle-matrix-table.py results.json > table.md
"""
import json
import sys


def counters(c):
    """P's exports (started/pulled/expired), D's loads (started/landed/failed), and the rest
    when they moved."""
    out = "exp %d/%d/%d, loads %d/%d/%d" % (
        c.get("p_exports_started", 0), c.get("p_exports_pulled", 0),
        c.get("p_exports_expired", 0), c.get("d_loads_started", 0),
        c.get("d_loads_landed", 0), c.get("d_loads_failed", 0))
    for key, name in [("preemptions", "preempted"), ("tier_stores", "stored"),
                      ("tier_loads", "tier loads"), ("tier_flushes", "flushes")]:
        if c.get(key):
            out += ", %s %d" % (name, c[key])
    return out


def main():
    results = json.load(open(sys.argv[1]))
    order = {("tiny", "off", "fail"): 0, ("tiny", "on", "fail"): 1,
             ("tiny", "off", "recompute"): 2}
    # D's kv_load_failure_policy: "fail" (the default) unless the run says otherwise.
    policy = lambda r: r.get("policy", "fail").split()[0]
    results.sort(key=lambda r: order.get((r["model"], r["tier"], policy(r)), 3))
    print("| case | model | tier | D's policy | reply ms (bound) | other calls, ms | "
          "requests: finished / aborted / left | transfers | result |")
    print("| --- | --- | --- | --- | ---: | --- | --- | --- | --- |")
    for r in results:
        reply = "-" if r["reply_ms"] is None else "%.1f (%d)" % (r["reply_ms"], r["bound_ms"])
        main = next((i for i, c in enumerate(r["calls"])
                     if r["reply_ms"] == c["reply_ms"] and r["bound_ms"] == c["bound_ms"]), 0)
        others = "; ".join("%s: %d %.1f" % (c["call"].replace(" on both", "").replace("|", "/"),
                                             c["status"], c["reply_ms"])
                           for i, c in enumerate(r["calls"]) if i != main) or "-"
        n = r["counts"]
        requests = "%d: %d / %d / %d" % (n["n_requests"], n["n_finished"], n["n_aborted"],
                                         n["n_disconnected"])
        if n["n_failed"]:
            requests += ", %d failed" % n["n_failed"]
        result = "pass" if r["pass"] else "**FAIL**: " + (r["error"] or "").splitlines()[0]
        if r["notes"]:
            result += " (" + "; ".join(r["notes"]).replace('"', "") + ")"
        print("| %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            r["case"], r["model"], r["tier"], policy(r), reply, others, requests,
            counters(r["counters"]), result))


if __name__ == "__main__":
    main()
