"""A small client for `ferry serve --enable-admin-api`: streamed rollouts that remember which
tokens came before each weight update, and the admin calls of the RL cycle. Standard library
only (http.client), so it runs on any Python 3.

Why stream: a non-streamed choice reports the distinct weight versions of its tokens in order
(`weight_versions`), not where one ends and the next begins. The trainer needs that boundary to
recompute each token's logprob under the weights that generated it. Weights only change while
the engine is paused, so the client marks, at every update, how many tokens each in-flight choice
has received; it first waits until it has received every token the engine generated before the
pause (`ferry_generation_tokens_total` from /metrics), so the mark is exact, not a guess from
timing.
"""

import http.client
import json
import re
import struct
import threading
import time
import urllib.parse


class FerryError(RuntimeError):
    pass


class Choice:
    def __init__(self, start_version):
        self.token_ids = []
        self.logprobs = []
        self.text = ""
        self.finish_reason = None
        self.weight_versions = None  # as ferry reports them
        # [(n_tokens_before, version)]: the tokens from n_tokens_before on came from version.
        self.segments = [(0, start_version)]

    def token_versions(self):
        """The version of each token, from the update marks."""
        out = []
        for i in range(len(self.token_ids)):
            v = None
            for start, ver in self.segments:
                if start <= i:
                    v = ver
            out.append(v)
        return out

    def versions_in_order(self):
        """Distinct versions of the tokens, in order: what `weight_versions` should say."""
        out = []
        for v in self.token_versions():
            if not out or out[-1] != v:
                out.append(v)
        return out


class Rollout:
    """One request with `n` choices (one GRPO group)."""

    def __init__(self, item, prompt_ids, n, start_version):
        self.item = item
        self.prompt_ids = prompt_ids
        self.choices = [Choice(start_version) for _ in range(n)]
        self.prompt_ids_reported = None
        self.usage = None
        self.error = None
        self.done = threading.Event()
        self.t_submit = time.perf_counter()
        self.t_done = None


class Ferry:
    def __init__(self, url, model=None, timeout=600):
        u = urllib.parse.urlparse(url)
        self.host, self.port = u.hostname, u.port or 80
        self.timeout = timeout
        self.model = model
        self.lock = threading.Lock()
        self.received_tokens = 0  # over every rollout of this client
        self.in_flight = []
        self.n_submitted = 0

    # -- plain calls -------------------------------------------------------------------
    def _conn(self):
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def call(self, method, path, body=None, headers=None, expect_json=True):
        c = self._conn()
        try:
            if isinstance(body, (dict, list)):
                body = json.dumps(body).encode()
                headers = {"Content-Type": "application/json", **(headers or {})}
            c.request(method, path, body=body, headers=headers or {})
            r = c.getresponse()
            data = r.read()
        finally:
            c.close()
        if r.status != 200:
            raise FerryError(f"{method} {path}: HTTP {r.status}: {data[:500]!r}")
        return json.loads(data) if expect_json else data.decode()

    def healthy(self):
        try:
            c = self._conn()
            c.request("GET", "/health")
            ok = c.getresponse().status == 200
            c.close()
            return ok
        except OSError:
            return False

    def metric(self, name):
        text = self.call("GET", "/metrics", expect_json=False)
        m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        if not m:
            raise FerryError(f"/metrics has no {name}")
        return float(m.group(1))

    def weight_version(self):
        return self.call("GET", "/weight_info")["weight_version"]

    def tokenize_chat(self, messages):
        return self.call("POST", "/tokenize", {"messages": messages})["tokens"]

    def tokenize(self, text):
        return self.call("POST", "/tokenize", {"prompt": text})["tokens"]

    # -- the RL cycle ------------------------------------------------------------------
    def pause(self, clear_cache=True):
        q = "mode=keep&clear_cache=" + ("true" if clear_cache else "false")
        return self.call("POST", "/pause?" + q)

    def resume(self):
        return self.call("POST", "/resume")

    def update_weights(self, blob, version):
        path = "/update_weights?weight_version=" + urllib.parse.quote(version)
        return self.call("POST", path, body=blob, headers={"Content-Type": "application/octet-stream"})

    def upload_weights(self, tensors, version, bucket_bytes=64 << 20):
        """Pushes {name: torch tensor} as a bucketed upload (docs/weight-sync.md): buckets of
        about `bucket_bytes`, each sent as its tensors are serialised (no bucket, let alone the
        state dict, is ever one bytes object), then one commit installs all under `version`.
        Returns the commit's reply; on an error the upload is discarded."""
        up = self.call("POST", "/weight_uploads", {"weight_version": version})
        uid = up["upload_id"]
        try:
            for names in _buckets(tensors, bucket_bytes):
                self._send_bucket(f"/weight_uploads/{uid}/buckets", tensors, names)
            return self.call("POST", f"/weight_uploads/{uid}/commit", {})
        except BaseException:
            try:
                self.call("DELETE", f"/weight_uploads/{uid}")
            except FerryError:
                pass  # already discarded by the error
            raise

    def _send_bucket(self, path, tensors, names):
        """One bucket in safetensors framing: the header, then each tensor's bytes straight
        from its array as it is converted (the conversion of one overlaps the sending of the
        last)."""
        header, off = {}, 0
        for name in names:
            t = tensors[name]
            n = t.numel() * 4
            header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + n]}
            off += n
        h = json.dumps(header, separators=(",", ":")).encode()
        h += b" " * (-len(h) % 8)

        def pieces():
            yield struct.pack("<Q", len(h)) + h
            import torch  # the trainer's; the rest of this client needs none

            for name in names:
                a = tensors[name].detach().to(torch.float32).contiguous().cpu().numpy()
                yield memoryview(a).cast("B")

        # With a Content-Length, http.client sends an iterable body piece by piece as is.
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(8 + len(h) + off)}
        return self.call("POST", path, body=pieces(), headers=headers)

    def wait_received(self, target, timeout=60.0):
        """Waits until this client has received `target` tokens in all (see the module doc)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                got = self.received_tokens
            if got >= target:
                return got
            if time.monotonic() > deadline:
                raise FerryError(f"received {got} tokens, the engine generated {target}")
            time.sleep(0.002)

    def mark_update(self, version):
        """Called while paused, after wait_received: later tokens of in-flight choices come
        from `version`."""
        n_marked = 0
        with self.lock:
            for r in self.in_flight:
                for c in r.choices:
                    if c.finish_reason is None:
                        c.segments.append((len(c.token_ids), version))
                        n_marked += 1
        return n_marked

    # -- rollouts ----------------------------------------------------------------------
    def submit(self, item, prompt_ids, n, max_tokens, start_version, extra=None):
        r = Rollout(item, prompt_ids, n, start_version)
        body = {
            "prompt": prompt_ids,
            "n": n,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "logprobs": 1,
            "return_token_ids": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **(extra or {}),
        }
        if self.model:
            body["model"] = self.model
        with self.lock:
            self.in_flight.append(r)
            self.n_submitted += 1
        threading.Thread(target=self._run, args=(r, body), daemon=True).start()
        return r

    def _run(self, r, body):
        try:
            c = self._conn()
            c.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                      headers={"Content-Type": "application/json"})
            resp = c.getresponse()
            if resp.status != 200:
                raise FerryError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                self._absorb(r, json.loads(data))
            c.close()
        except Exception as e:  # reported by the caller
            r.error = repr(e)
        finally:
            r.t_done = time.perf_counter()
            with self.lock:
                if r in self.in_flight:
                    self.in_flight.remove(r)
            r.done.set()

    def _absorb(self, r, chunk):
        if chunk.get("usage"):
            r.usage = chunk["usage"]
        with self.lock:
            for ch in chunk.get("choices") or []:
                c = r.choices[ch["index"]]
                ids = ch.get("token_ids") or []
                c.token_ids.extend(ids)
                self.received_tokens += len(ids)
                lp = ch.get("logprobs") or {}
                c.logprobs.extend(lp.get("token_logprobs") or [])
                c.text += ch.get("text") or ""
                if ch.get("prompt_token_ids") is not None:
                    r.prompt_ids_reported = ch["prompt_token_ids"]
                if ch.get("finish_reason") is not None:
                    c.finish_reason = ch["finish_reason"]
                    c.weight_versions = ch.get("weight_versions")


def _buckets(tensors, bucket_bytes):
    """Tensor names in name order, cut into buckets of about `bucket_bytes` (f32) each."""
    bucket, size = [], 0
    for name in sorted(tensors):
        n = tensors[name].numel() * 4
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(name)
        size += n
    if bucket:
        yield bucket
