#!/usr/bin/env python3
"""Smoke test of a running `ferry serve` with the official `openai` Python client.

Usage: smoke-openai.py BASE_URL [SUITE]   (e.g. http://127.0.0.1:8000; scripts/smoke-openai.sh starts the
server and calls this). Each check prints a cargo-style `test NAME ... ok|FAILED` line, and the
run closes with `test result: ...`, so scripts/test.sh counts the checks with cargo's tests.
Exits non-zero if any check fails.
"""

import json
import math
import sys
import traceback

import openai

MAX_TOKENS = 8
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Say something about ferries."}]
# The model can stop early on its own; these make the length exact and the finish reason "length".
EXACT = {"ignore_eos": True}


def extra(obj, name):
    """A field outside the OpenAI schema (the client keeps unknown fields as extras)."""
    value = getattr(obj, name, None)
    if value is None and obj.model_extra:
        value = obj.model_extra.get(name)
    return value


def check(cond, what):
    if not cond:
        raise AssertionError(what)


class Smoke:
    def __init__(self, base_url):
        self.client = openai.OpenAI(
            base_url=base_url.rstrip("/") + "/v1",
            api_key="unused",
            max_retries=0,  # a retry would hide a failure
            timeout=120,
        )
        self.model = None

    # Each test_* method is one check; they run in definition order.

    def test_models_lists_the_served_model(self):
        models = self.client.models.list().data
        check(len(models) >= 1, f"no models: {models}")
        self.model = models[0].id

    def complete(self, **kw):
        kw.setdefault("max_tokens", MAX_TOKENS)
        return self.client.completions.create(model=self.model, temperature=0, **kw)

    def chat(self, **kw):
        kw.setdefault("max_tokens", MAX_TOKENS)
        return self.client.chat.completions.create(model=self.model, temperature=0, **kw)

    def test_completion_usage_and_finish_reason(self):
        r = self.complete(prompt=PROMPT, extra_body=EXACT)
        check(len(r.choices) == 1, f"choices: {r.choices}")
        check(r.choices[0].finish_reason == "length", f"finish_reason {r.choices[0].finish_reason}")
        check(r.usage.completion_tokens == MAX_TOKENS, f"usage {r.usage}")
        check(r.usage.prompt_tokens > 0, f"usage {r.usage}")
        check(r.usage.total_tokens == r.usage.prompt_tokens + MAX_TOKENS, f"usage {r.usage}")

    def test_choices_report_their_weight_versions(self):
        # ferry's non-standard field: the weight versions the tokens were computed with.
        r = self.complete(prompt=PROMPT, extra_body=EXACT)
        versions = extra(r.choices[0], "weight_versions")
        check(isinstance(versions, list) and len(versions) == 1, f"weight_versions {versions!r}")
        c = self.chat(messages=MESSAGES, extra_body=EXACT)
        check(extra(c.choices[0], "weight_versions") == versions, f"chat {c.choices[0]}")

    def test_answers_carry_the_fields_vllm_always_carries(self):
        # vLLM's conformance tests read these as attributes; a missing one is an AttributeError.
        r = self.complete(prompt=PROMPT, extra_body=EXACT)
        check(r.choices[0].prompt_logprobs is None, f"prompt_logprobs {r.choices[0]}")
        check(r.system_fingerprint is None, f"system_fingerprint {r}")
        c = self.chat(messages=MESSAGES, extra_body=EXACT)
        check(c.prompt_logprobs is None, f"chat prompt_logprobs {c}")
        check(c.choices[0].message.reasoning is None, f"reasoning {c.choices[0].message}")

    def test_completion_stream_equals_non_stream(self):
        whole = self.complete(prompt=PROMPT, extra_body=EXACT)
        chunks = list(
            self.complete(
                prompt=PROMPT,
                extra_body=EXACT,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        check(text == whole.choices[0].text, f"streamed {text!r} != {whole.choices[0].text!r}")
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        check(finishes == ["length"], f"finish reasons in stream: {finishes}")
        usage = [c.usage for c in chunks if c.usage]
        check(len(usage) == 1 and usage[0].completion_tokens == MAX_TOKENS, f"stream usage {usage}")
        check(not chunks[-1].choices, "the usage chunk should come last, with no choices")

    def test_completion_logprobs_are_greedy(self):
        r = self.complete(prompt=PROMPT, logprobs=2, extra_body=EXACT)
        lp = r.choices[0].logprobs
        check(lp is not None, "no logprobs")
        check(len(lp.tokens) == MAX_TOKENS and len(lp.token_logprobs) == MAX_TOKENS, f"logprobs {lp}")
        # (No check that the tokens join to the text: a byte-level model's token can be part of
        # a UTF-8 character, which a per-token string cannot show.)
        for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
            check(chosen <= 0 and math.isfinite(chosen), f"logprob {chosen}")
            check(1 <= len(top) <= 2, f"top_logprobs {top}")
            # Greedy: the chosen token is the most likely one.
            check(chosen >= max(top.values()) - 1e-4, f"chosen {chosen} below top {top}")

    def test_completion_n2(self):
        r = self.complete(prompt=PROMPT, n=2, extra_body=EXACT)
        check(sorted(c.index for c in r.choices) == [0, 1], f"choices {r.choices}")
        # Both greedy: the same text.
        check(r.choices[0].text == r.choices[1].text, f"greedy n=2 differ: {r.choices}")
        check(r.usage.completion_tokens == 2 * MAX_TOKENS, f"usage {r.usage}")

    def test_completion_return_token_ids_and_token_prompt(self):
        r = self.complete(prompt=PROMPT, extra_body={"return_token_ids": True, **EXACT})
        choice = r.choices[0]
        prompt_ids = extra(choice, "prompt_token_ids") or extra(r, "prompt_token_ids")
        out_ids = extra(choice, "token_ids")
        check(isinstance(prompt_ids, list) and len(prompt_ids) == r.usage.prompt_tokens, f"prompt_token_ids {prompt_ids}")
        check(isinstance(out_ids, list) and len(out_ids) == MAX_TOKENS, f"token_ids {out_ids}")
        # The same prompt as token ids gives the same greedy continuation.
        again = self.complete(prompt=prompt_ids, extra_body=EXACT)
        check(again.choices[0].text == choice.text, f"{again.choices[0].text!r} != {choice.text!r}")

    def test_chat_usage_and_finish_reason(self):
        r = self.chat(messages=MESSAGES, extra_body=EXACT)
        msg = r.choices[0].message
        check(msg.role == "assistant", f"role {msg.role}")
        check(isinstance(msg.content, str), f"content {msg.content!r}")
        check(r.choices[0].finish_reason == "length", f"finish_reason {r.choices[0].finish_reason}")
        check(r.usage.completion_tokens == MAX_TOKENS and r.usage.prompt_tokens > 0, f"usage {r.usage}")

    def test_chat_stream_equals_non_stream(self):
        whole = self.chat(messages=MESSAGES, extra_body=EXACT)
        chunks = list(
            self.chat(
                messages=MESSAGES,
                extra_body=EXACT,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        want = whole.choices[0].message.content
        check(text == want, f"streamed {text!r} != {want!r}")
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        check(finishes == ["length"], f"finish reasons in stream: {finishes}")
        usage = [c.usage for c in chunks if c.usage]
        check(len(usage) == 1 and usage[0].completion_tokens == MAX_TOKENS, f"stream usage {usage}")

    def test_chat_logprobs(self):
        r = self.chat(messages=MESSAGES, logprobs=True, top_logprobs=2, extra_body=EXACT)
        content = r.choices[0].logprobs.content
        check(len(content) == MAX_TOKENS, f"{len(content)} logprob entries")
        for entry in content:
            check(entry.logprob <= 0 and 1 <= len(entry.top_logprobs) <= 2, f"entry {entry}")
            check(entry.logprob >= max(t.logprob for t in entry.top_logprobs) - 1e-4, f"not greedy: {entry}")

    def test_chat_n2_and_return_token_ids(self):
        r = self.chat(messages=MESSAGES, n=2, extra_body={"return_token_ids": True, **EXACT})
        check(sorted(c.index for c in r.choices) == [0, 1], f"choices {r.choices}")
        check(r.choices[0].message.content == r.choices[1].message.content, "greedy n=2 differ")
        prompt_ids = extra(r, "prompt_token_ids") or extra(r.choices[0], "prompt_token_ids")
        check(isinstance(prompt_ids, list) and len(prompt_ids) == r.usage.prompt_tokens, f"prompt_token_ids {prompt_ids}")
        for c in r.choices:
            ids = extra(c, "token_ids")
            check(isinstance(ids, list) and len(ids) == MAX_TOKENS, f"token_ids {ids}")

    def test_bad_requests_raise_bad_request_error(self):
        cases = {
            "negative max_tokens": lambda: self.complete(prompt=PROMPT, max_tokens=-1),
            "bad type": lambda: self.complete(prompt=PROMPT, extra_body={"temperature": "hot"}),
            # (A custom role is passed to the chat template, as vLLM does: not an error.)
            "message without a role": lambda: self.chat(messages=[{"content": "hi"}]),
        }
        for name, call in cases.items():
            try:
                call()
            except openai.BadRequestError as e:
                check(e.status_code == 400, f"{name}: status {e.status_code}")
                continue
            raise AssertionError(f"{name}: no BadRequestError")

    def test_unknown_model_raises_not_found_error(self):
        # As the OpenAI and vLLM servers answer; the body keeps the OpenAI error shape.
        for call in (
            lambda: self.client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=1),
            lambda: self.client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=1),
        ):
            try:
                call()
            except openai.NotFoundError as e:
                check(e.status_code == 404, f"status {e.status_code}")
                check("no-such-model" in str(e), f"message {e}")
                continue
            raise AssertionError("unknown model: no NotFoundError")

    def test_structured_outputs_through_the_client(self):
        # OpenAI's response_format, as the client sends it, and vLLM's extra fields.
        schema = {
            "type": "object",
            "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
            "required": ["answer"],
            "additionalProperties": False,
            "x-guidance": {"whitespace_flexible": False},
        }
        r = self.chat(
            messages=MESSAGES,
            max_tokens=32,
            response_format={"type": "json_schema", "json_schema": {"name": "yes_no", "schema": schema, "strict": True}},
        )
        content = r.choices[0].message.content
        check(r.choices[0].finish_reason == "stop", f"finish_reason {r.choices[0].finish_reason}: {content!r}")
        check(json.loads(content)["answer"] in ("yes", "no"), f"content {content!r}")
        forced = extra(r.choices[0], "forced_tokens")
        check(isinstance(forced, list) and forced and forced[-1] is True, f"forced_tokens {forced}")
        r = self.complete(prompt=PROMPT, max_tokens=16,
                          extra_body={"structured_outputs": {"choice": ["port", "starboard"]}})
        check(r.choices[0].text in ("port", "starboard"), f"choice {r.choices[0].text!r}")
        try:
            self.complete(prompt=PROMPT, max_tokens=4, extra_body={"guided_regex": "([a-z]"})
        except openai.BadRequestError as e:
            check(e.status_code == 400 and "guided_regex" in str(e), f"{e}")
        else:
            raise AssertionError("invalid regex: no BadRequestError")

    # Tool calls (the servers run with --enable-auto-tool-choice --tool-call-parser hermes).
    # The tiny model writes no calls of its own: `required` and named calls are constrained
    # by the tools' schemas; `auto` gets a request's own constraint in the hermes format.
    def test_tool_calls_of_every_tool_choice(self):
        calls = {}
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            r = self.chat(messages=MESSAGES, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                          max_tokens=200)
            m = r.choices[0].message
            check(m.content is None and m.tool_calls and len(m.tool_calls) == 1, f"{choice}: {m}")
            call = m.tool_calls[0]
            check(call.type == "function" and call.id, f"{call}")
            check_tool_args(call.function.name, call.function.arguments)
            want = "stop" if isinstance(choice, dict) else "tool_calls"
            check(r.choices[0].finish_reason == want, f"{choice}: finish_reason {r.choices[0].finish_reason}")
            # Streamed: the deltas join to the same call.
            joined = join_tool_stream(self.chat(messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                                parallel_tool_calls=False, max_tokens=200, stream=True))
            check(joined["calls"] == [(call.function.name, call.function.arguments)], f"{joined} != {call}")
            check(joined["content"] == "" and joined["finish_reason"] == want, f"{joined}")
            calls[str(choice)] = r
        r = self.chat(messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=4)
        check(not r.choices[0].message.tool_calls and r.choices[0].message.content, f"none: {r.choices[0]}")
        # auto: two calls after some text, in hermes's format.
        r = self.chat(messages=MESSAGES, tools=TOOLS, max_tokens=300, extra_body={"structured_outputs": {"grammar": HERMES_GRAMMAR}})
        m = r.choices[0].message
        check(m.content == "Sure." and len(m.tool_calls or []) == 2, f"auto: {m}")
        for call in m.tool_calls:
            check_tool_args(call.function.name, call.function.arguments)
        check(r.choices[0].finish_reason == "tool_calls", f"auto finish {r.choices[0].finish_reason}")
        joined = join_tool_stream(self.chat(messages=MESSAGES, tools=TOOLS, max_tokens=300, stream=True,
                                            extra_body={"structured_outputs": {"grammar": HERMES_GRAMMAR}}))
        check(joined["calls"] == [(c.function.name, c.function.arguments) for c in m.tool_calls], f"{joined}")
        check(joined["content"] == "Sure." and joined["finish_reason"] == "tool_calls", f"{joined}")
        # The next turn: the calls and their results go back as the client returns them.
        history = MESSAGES + [m.model_dump(exclude_none=True)] + [
            {"role": "tool", "tool_call_id": c.id, "content": "12 degrees"} for c in m.tool_calls
        ]
        r = self.chat(messages=history, tools=TOOLS, tool_choice="none", max_tokens=4)
        check(r.choices[0].message.content, f"next turn: {r.choices[0]}")
        # Bad input is a 400 naming the field.
        try:
            self.chat(messages=MESSAGES, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
        except openai.BadRequestError as e:
            check(e.status_code == 400 and "nope" in str(e), f"{e}")
        else:
            raise AssertionError("unknown tool: no BadRequestError")


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                       "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["a", "b"], "additionalProperties": False}}},
]
# Text, then two hermes calls of get_weather.
HERMES_GRAMMAR = (
    'start: "Sure." call call\n'
    'call: "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": " args "}\\n</tool_call>"\n'
    'args: %json {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"], '
    '"additionalProperties": false, "x-guidance": {"whitespace_flexible": false}}\n'
)


def check_tool_args(name, arguments):
    args = json.loads(arguments)
    if name == "get_weather":
        check(set(args) == {"city"} and args["city"] in ("Paris", "Oslo"), f"{name} {arguments}")
    else:
        check(name == "add" and set(args) == {"a", "b"} and all(0 <= v <= 9 for v in args.values()),
              f"{name} {arguments}")


def join_tool_stream(stream):
    """A streamed choice's content, calls (name, arguments) joined by index, finish_reason."""
    content, calls, finish = "", [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.index == len(calls):
                check(d.id and d.function.name, f"first delta of a call: {d}")
                calls.append([d.function.name, ""])
            calls[d.index][1] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return {"content": content, "calls": [tuple(c) for c in calls], "finish_reason": finish}


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(f"usage: {sys.argv[0]} BASE_URL [SUITE]")
    smoke = Smoke(sys.argv[1])
    # The suite names the server behind BASE_URL in the test names (`ferry proxy` runs the
    # same checks as `ferry serve`).
    suite = "smoke_openai" if len(sys.argv) == 2 else f"smoke_openai_{sys.argv[2]}"
    names = [n for n in Smoke.__dict__ if n.startswith("test_")]
    failed = 0
    for name in names:
        try:
            getattr(smoke, name)()
            print(f"test {suite}::{name} ... ok", flush=True)
        except Exception:  # every failure is reported, and the run goes on
            failed += 1
            print(f"test {suite}::{name} ... FAILED", flush=True)
            traceback.print_exc(file=sys.stdout)
            if smoke.model is None:
                break
    passed = len(names) - failed if smoke.model is not None else 0
    failed = len(names) - passed
    outcome = "ok" if failed == 0 else "FAILED"
    print(f"\ntest result: {outcome}. {passed} passed; {failed} failed; 0 ignored (openai {openai.__version__})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
