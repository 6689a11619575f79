"""A KV event subscriber as vLLM's consumers write one: pyzmq SUB (+ DEALER for replays) and
msgspec structs declared in the field order of vLLM 0.11.0's vllm/distributed/kv_events.py
(array_like, omit_defaults, tagged events). ferry's two trailing batch fields (weight version,
cache epoch) are read with a second struct that extends vLLM's, so the test checks both that
vLLM's own decoder accepts ferry's batches and what the extra fields say.

Usage: subscriber.py ENDPOINT REPLAY_ENDPOINT TOPIC
Prints one JSON line per batch received live ({"seq", "recv", "events", ...}); on stdin line
"replay N" asks the replay socket for every batch from N and prints {"replayed": [...]}; on
"quit" exits. Prints {"ready": true} once subscribed.
"""

import json
import sys
import threading
import time

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class FerryBatch(KVEventBatch):
    """vLLM's batch with ferry's trailing fields."""

    weight_version: str = ""
    epoch: int = 0


vllm_decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
ferry_decoder = msgspec.msgpack.Decoder(type=FerryBatch)


def describe(seq, payload):
    vllm = vllm_decoder.decode(payload)  # vLLM's own decoder must accept the batch
    ours = ferry_decoder.decode(payload)
    events = []
    for e in vllm.events:
        if isinstance(e, BlockStored):
            events.append({"type": "BlockStored", "block_hashes": e.block_hashes,
                           "parent_block_hash": e.parent_block_hash, "token_ids": e.token_ids,
                           "block_size": e.block_size, "medium": e.medium})
        elif isinstance(e, BlockRemoved):
            events.append({"type": "BlockRemoved", "block_hashes": e.block_hashes,
                           "medium": e.medium})
        else:
            events.append({"type": "AllBlocksCleared"})
    return {"seq": seq, "recv": time.time(), "ts": vllm.ts, "events": events,
            "weight_version": ours.weight_version, "epoch": ours.epoch}


def main():
    endpoint, replay_endpoint, topic = sys.argv[1], sys.argv[2], sys.argv[3].encode()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    lock = threading.Lock()

    def out(obj):
        with lock:
            print(json.dumps(obj), flush=True)

    def live():
        while True:
            t, seq, payload = sub.recv_multipart()
            assert t == topic, t
            out(describe(int.from_bytes(seq, "big"), payload))

    # The SUB socket needs a moment to join (ZMQ's slow joiner); the test sends nothing it
    # must see live until this says so, and checks the rest through the replay.
    time.sleep(0.5)
    threading.Thread(target=live, daemon=True).start()
    out({"ready": True})
    for line in sys.stdin:
        cmd = line.split()
        if cmd and cmd[0] == "replay":
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(replay_endpoint)
            dealer.send_multipart([b"", int(cmd[1]).to_bytes(8, "big")])
            got = []
            while True:
                _, seq, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq, "big", signed=True)
                if seq == -1:
                    break
                got.append(describe(seq, payload))
            dealer.close()
            out({"replayed": got})
        elif cmd and cmd[0] == "quit":
            return


if __name__ == "__main__":
    main()
