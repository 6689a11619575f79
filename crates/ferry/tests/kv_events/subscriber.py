"""A KV event subscriber on libzmq, as vLLM's consumers connect: pyzmq SUB for live batches
and DEALER for replays, in the framing of vLLM 0.34.0's publisher. It decodes nothing: it
hands every batch's bytes to the test (kv_events.rs), which checks they are what ferry's
encoder writes for the events they carry; that encoder writes what vLLM 0.34.0's own code
writes (crates/ferry-kv-events/tests/vllm_golden.rs, against batches vLLM's kv_events.py
published, made by scripts/golden/make_kv_events.py).

Usage: subscriber.py ENDPOINT REPLAY_ENDPOINT TOPIC
Prints one JSON line per batch received live ({"seq", "recv", "payload": hex}); on stdin line
"replay N" asks the replay socket for every batch from N and prints {"replayed": [...]}; on
"quit" exits. Prints {"ready": true} once subscribed.
"""

import json
import sys
import threading
import time

import zmq

END = (-1).to_bytes(8, "big", signed=True)


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
            out({"seq": int.from_bytes(seq, "big"), "recv": time.time(),
                 "payload": payload.hex()})

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
                empty, t, seq, payload = dealer.recv_multipart()
                assert empty == b"", empty
                if seq == END:
                    assert (t, payload) == (b"", b""), (t, payload)
                    break
                assert t == topic, t
                got.append({"seq": int.from_bytes(seq, "big"), "payload": payload.hex()})
            dealer.close()
            out({"replayed": got})
        elif cmd and cmd[0] == "quit":
            return


if __name__ == "__main__":
    main()
