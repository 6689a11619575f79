#!/usr/bin/env python3
"""KV event batches as vLLM's own code puts them on the wire, for ferry's wire tests.

For each pinned vLLM version, downloads its wheel (`pip download vllm==V --no-deps`, no torch),
takes `vllm/distributed/kv_events.py` out of it, loads that file with stand-ins for the few
vLLM modules it imports (a logger, the config class, network helpers it does not call here;
`ExternalBlockHash` is evaluated from the wheel's own `kv_cache_utils.py`), and then:

* builds every case of `cases.json` with the module's own event classes (a field the version's
  class does not have is left out and listed in the output),
* publishes the batches through the module's own `ZmqEventPublisher` (on `inproc://`
  sockets: no network) and reads them back with a replay from sequence 0, so each payload is
  exactly what vLLM's publisher sends, `data_parallel_rank` filled as it fills it,
* asks the same publisher for a replay from sequence 1 and keeps every frame of its answer
  (the replay's framing, end marker included),
* checks that the module's own `KVEventBatch` decoder reads every ferry case and ignores
  ferry's two extra batch fields.

ferry's extra fields (`weight_version`, `epoch`) are written by a subclass of the version's
own `KVEventBatch` that appends them, so msgspec lays them out after vLLM's fields.

Writes crates/ferry-kv-events/tests/golden/vllm-V.json, read by
crates/ferry-kv-events/tests/vllm_golden.rs. Needs PyPI, msgspec and pyzmq (vLLM 0.34.0
requires msgspec, any version, and pyzmq >= 25; the goldens were made with the versions below); run from
anywhere:

    python3 -m pip install msgspec==0.23.0 pyzmq==27.3.0
    python3 scripts/golden/make_kv_events.py

Each wheel is downloaded to a temporary folder and deleted (0.34.0: 239 MB, 0.11.0: 438 MB);
the tests need none of it.
"""

import ast
import hashlib
import json
import logging
import pathlib
import subprocess
import sys
import tempfile
import time
import types
import typing
import zipfile

import msgspec
import zmq

# The newest release (its kv_events.py is the same file as 0.33.0's) and the one ferry's
# first encoder followed, whose batches ferry's decoder still reads.
VERSIONS = ["0.34.0", "0.11.0"]

ROOT = pathlib.Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "crates/ferry-kv-events/tests/golden"


def wheel_files(version, tmp):
    """The wheel's kv_events.py and kv_cache_utils.py, and the wheel's name and sha256."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
         "--no-deps", "--only-binary", ":all:", f"vllm=={version}", "-d", str(tmp)],
        check=True,
    )
    (wheel,) = tmp.glob(f"vllm-{version}-*.whl")
    sha = hashlib.sha256()
    with open(wheel, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
    with zipfile.ZipFile(wheel) as z:
        events = z.read("vllm/distributed/kv_events.py").decode()
        utils = z.read("vllm/v1/core/kv_cache_utils.py").decode()
    wheel_name = wheel.name
    wheel.unlink()
    return events, utils, wheel_name, sha.hexdigest()


def external_block_hash(utils_source):
    """`ExternalBlockHash` as the wheel's kv_cache_utils.py defines it (its right-hand side,
    evaluated), without importing that module (it needs torch)."""
    for node in ast.parse(utils_source).body:
        target = getattr(node, "target", None) or (getattr(node, "targets", None) or [None])[0]
        if isinstance(target, ast.Name) and target.id == "ExternalBlockHash":
            return eval(compile(ast.Expression(node.value), "kv_cache_utils.py", "eval"),
                        {"Union": typing.Union, "bytes": bytes, "int": int})
    raise SystemExit("no ExternalBlockHash in kv_cache_utils.py")


def load_kv_events(version, events_source, utils_source):
    """The wheel's kv_events.py as a module, with stand-ins for what it imports from vLLM."""

    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    class KVEventsConfig:
        """Stand-in: the publisher only stores one (0.34) or reads none (0.11)."""

        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

    def not_here(*_args, **_kwargs):
        raise RuntimeError("not called for inproc:// endpoints")

    for name in ["vllm", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core"]:
        module(name)
    module("vllm.config.kv_events", KVEventsConfig=KVEventsConfig)
    module("vllm.logger", init_logger=logging.getLogger)
    module("vllm.utils.network_utils", get_ip=not_here, get_tcp_uri=not_here,
           is_valid_ipv6_address=not_here, split_zmq_path=not_here)
    module("vllm.v1.core.kv_cache_utils",
           ExternalBlockHash=external_block_hash(utils_source))
    name = f"vllm_{version.replace('.', '_')}_kv_events"
    mod = types.ModuleType(name)
    sys.modules[name] = mod  # msgspec resolves the classes' annotations through it
    exec(compile(events_source, f"vllm-{version}/vllm/distributed/kv_events.py", "exec"),
         mod.__dict__)
    return mod


def event(mod, spec, dropped):
    """One event of cases.json built with the module's class; fields the class lacks are
    left out and noted in `dropped`."""
    cls = getattr(mod, spec["type"])
    fields = {f.name for f in msgspec.structs.fields(cls)}
    kwargs = {}
    for k, v in spec.items():
        if k == "type":
            continue
        if k not in fields:
            dropped.setdefault(spec["type"], set()).add(k)
            continue
        if k in ("block_hashes", "parent_block_hash"):
            v = [bytes.fromhex(h) if isinstance(h, str) else h for h in v] if k == "block_hashes" \
                else (bytes.fromhex(v) if isinstance(v, str) else v)
        if k == "extra_keys" and v is not None:
            v = [tuple(e) if e is not None else None for e in v]
        kwargs[k] = v
    return cls(**kwargs)


def batches(mod, cases, dropped):
    """Each case as the batch vLLM's scheduler hands its publisher, and the same batch as
    vLLM's class reads it (ferry's fields aside)."""

    class FerryBatch(mod.KVEventBatch):
        weight_version: typing.Optional[str] = None
        epoch: typing.Optional[int] = None

    out = []
    for case in cases:
        events = [event(mod, e, dropped) for e in case["events"]]
        plain = dict(ts=case["ts"], events=events)
        if "data_parallel_rank" in case:
            plain["data_parallel_rank"] = case["data_parallel_rank"]
        ferry = case.get("ferry")
        sent = FerryBatch(**plain, **ferry) if ferry else mod.KVEventBatch(**plain)
        out.append((case, sent, mod.KVEventBatch(**plain)))
    return out


def replay(ctx, endpoint, start, n_wanted=None, within=10.0):
    """A replay request to vLLM's ROUTER socket: every message of the answer, as frames."""
    deadline = time.time() + within
    while True:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        messages = []
        while True:
            if not dealer.poll(int(max(0.0, deadline - time.time()) * 1000)):
                raise SystemExit(f"no replay from {endpoint}")
            frames = dealer.recv_multipart()
            messages.append(frames)
            if frames[-2] == (-1).to_bytes(8, "big", signed=True):
                break
        dealer.close(linger=0)
        # The publisher's thread may not have sent every batch yet: ask again.
        if n_wanted is None or len(messages) - 1 == n_wanted:
            return messages
        if time.time() > deadline:
            raise SystemExit(f"replay: {len(messages) - 1} batches, not {n_wanted}")
        time.sleep(0.05)


def run(version, spec):
    with tempfile.TemporaryDirectory() as tmp:
        events_source, utils_source, wheel, wheel_sha = wheel_files(version, pathlib.Path(tmp))
    mod = load_kv_events(version, events_source, utils_source)
    dropped = {}
    made = batches(mod, spec["cases"], dropped)
    tag = version.replace(".", "_")
    publisher = mod.ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=f"inproc://ferry-golden-pub-{tag}",
        replay_endpoint=f"inproc://ferry-golden-replay-{tag}",
        topic=spec["topic"],
    )
    for _, sent, _ in made:
        publisher.publish(sent)
    ctx = zmq.Context.instance()
    endpoint = f"inproc://ferry-golden-replay-{tag}"
    everything = replay(ctx, endpoint, 0, n_wanted=len(made))
    from_one = replay(ctx, endpoint, 1)
    publisher.shutdown()

    decoder = msgspec.msgpack.Decoder(type=mod.KVEventBatch)
    cases = {}
    for (case, _, plain), frames in zip(made, everything):
        payload = frames[-1]
        read = decoder.decode(payload)  # vLLM's own decoder, ferry's fields included
        if read.data_parallel_rank is None or read.ts != plain.ts or read.events != plain.events:
            raise SystemExit(f"{version} {case['name']}: vLLM's decoder read {read}")
        cases[case["name"]] = payload.hex()
    return {
        "about": f"KV event batches as vLLM {version}'s own kv_events.py encodes and publishes "
                 "them; made by scripts/golden/make_kv_events.py from cases.json",
        "vllm": version,
        "wheel": wheel,
        "wheel_sha256": wheel_sha,
        "kv_events_py_sha256": hashlib.sha256(events_source.encode()).hexdigest(),
        "msgspec": msgspec.__version__,
        "fields_not_in_this_version": {k: sorted(v) for k, v in sorted(dropped.items())},
        "topic": spec["topic"],
        "cases": cases,
        "replay_from_1": [[f.hex() for f in frames] for frames in from_one],
    }


def main():
    spec = json.loads((GOLDEN / "cases.json").read_text())
    for version in VERSIONS:
        out = run(version, spec)
        path = GOLDEN / f"vllm-{version}.json"
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
