#!/usr/bin/env python3
"""Chat templates rendered by Hugging Face transformers, for ferry's chat-template tests.

For three real templates (crates/ferry/tests/fixtures/chat_templates/: Qwen3-0.6B,
Llama-3.1-8B-Instruct, Hermes-3-Llama-3.1-8B's `tool_use` template), renders conversations with
tool calls, tool results, reasoning and system messages as a vLLM 0.34 server would:

* each request is written as ferry gets it (OpenAI messages: `tool_calls[].function.arguments`
  a JSON string, `content: null`, `reasoning`, `tool_call_id`; `tools`; `add_generation_prompt`;
  `chat_template_kwargs`),
* the messages are converted as vLLM 0.34 converts them before rendering (`vllm_messages`
  below), and the request's tools are passed as they came (vLLM's `tool.model_dump()` is the
  same dict for tools that give `name`, `description` and `parameters`, in that order),
* `tokenizer.apply_chat_template(messages, tools=..., chat_template=<the template>,
  add_generation_prompt=..., tokenize=False, **chat_template_kwargs)` gives the text, and the
  same call with `tokenize=True` the ids (transformers tokenizes the text with
  `add_special_tokens=False`); the script checks that the ids are the text's ids.

A case where transformers raises (Llama 3.1's template refuses two tool calls in one message;
Hermes' template cannot iterate over no tools) records the error instead: vLLM answers such a
request with a 400, and so must ferry (the test lets ferry render where only Jinja2's refusal
to iterate over None is at stake: minijinja iterates none as empty).

The tokenizer is ferry's default model's, SmolLM2-135M-Instruct, built by transformers from the
GGUF file ferry loads (`PreTrainedTokenizerFast.from_pretrained(dir, gguf_file=...)`, i.e.
transformers' own GGUF tokenizer conversion), with two adjustments:

* transformers' GGUF metadata reader imports torch (for tensors, which a tokenizer does not
  need), so `read_gguf_metadata` is replaced by a stand-in that reads the same keys with the
  `gguf` package; everything else is transformers' own code;
* transformers ignores `tokenizer.ggml.pre = "smollm"`, so, as scripts/golden/make_golden.py
  does, digits are split one by one in front of the byte-level split (SmolLM2's own
  tokenizer.json does that, and so does ferry). The script checks the result against the ids
  in crates/ferry-model/tests/golden/smollm2.json, which make_golden.py made through
  transformers' full GGUF path.

The bos/eos strings the templates see are SmolLM2's own (`<|im_start|>`, `<|im_end|>`: what
ferry passes); the Llama templates' `<|start_header_id|>` etc. are plain text to SmolLM2's
tokenizer. That is fine: these goldens check ferry's renderer and tokenization, not a model.
Llama 3.1's template reads `date_string`; every Llama case passes a fixed one through
`chat_template_kwargs` (recorded at the top of the golden file).

`turns` answers a question for RL: is turn n+1's prompt (the conversation plus the assistant
message as the API returns it plus a tool result, with `add_generation_prompt`) the ids of
turn n's prompt followed by the ids the model sampled (its output in the template's own
format, tokenized)? Per template and variant it records the inputs, both texts and id lists,
and the answer three ways: as text (does the new prompt text start with prompt + output?), as
SmolLM2 ids (what ferry's test checks through `/tokenize`), and whether the model's own
tokenizer would keep the text answer (its pre-tokenizer split, from transformers' copies of
the Qwen2 and Llama 3 regexes, and its special tokens: a text prefix is an id prefix when the
joins fall on pre-token boundaries). See docs/turn-tokens.md.

Writes crates/ferry/tests/golden/chat_templates.json, read by crates/ferry/tests/chat_templates.rs.

Pinned (what the golden was made with; the script refuses other versions):
transformers 5.25.0, jinja2 3.1.6, tokenizers 0.23.3, gguf 0.19.0 (all from PyPI; no torch).
To regenerate, with the default model fetched (`bash scripts/fetch-model.sh`):

    python3 -m venv /tmp/chat-golden-venv
    /tmp/chat-golden-venv/bin/pip install transformers==5.25.0 jinja2==3.1.6 \\
        tokenizers==0.23.3 gguf==0.19.0
    /tmp/chat-golden-venv/bin/python scripts/golden/make_chat_templates.py

`--gguf PATH` names another copy of the model file (default: ferry's cache,
${FERRY_CACHE:-~/.cache/ferry}/models/SmolLM2-135M-Instruct.Q4_1.gguf).
"""

import argparse
import copy
import hashlib
import json
import os
import pathlib
import re
import sys
import types

import gguf

PINS = {"transformers": "5.25.0", "jinja2": "3.1.6", "tokenizers": "0.23.3", "gguf": "0.19.0"}

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "crates/ferry/tests/fixtures/chat_templates"
OUT = ROOT / "crates/ferry/tests/golden/chat_templates.json"
SMOL_GOLDEN = ROOT / "crates/ferry-model/tests/golden/smollm2.json"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

QWEN3 = "Qwen-Qwen3-0.6B.jinja"
LLAMA31 = "meta-llama-Llama-3.1-8B-Instruct.jinja"
HERMES3 = "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja"
TEMPLATES = [QWEN3, LLAMA31, HERMES3]
SHORT = {QWEN3: "qwen3", LLAMA31: "llama3.1", HERMES3: "hermes3"}

# Llama 3.1's template prints "Today Date: {date_string}" (its default is "26 Jul 2024").
DATE_STRING = "14 Feb 2026"


# --- transformers' GGUF tokenizer, without torch -------------------------------------------


def read_gguf_metadata(gguf_path, string_arrays=()):
    """What transformers' `integrations.gguf.reader.read_gguf_metadata` returns, read with the
    `gguf` package: every metadata key, numeric arrays as lists, string arrays as lists when
    named in `string_arrays` and as their length otherwise; and the tensor names."""
    reader = gguf.GGUFReader(gguf_path)
    kinds = gguf.GGUFValueType
    metadata = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):  # the header's own fields, not metadata
            continue
        kind = field.types[0]
        if kind == kinds.ARRAY:
            if field.types[1] == kinds.STRING:
                if name in string_arrays:
                    metadata[name] = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
                else:
                    metadata[name] = len(field.data)
            else:
                metadata[name] = [field.parts[i].tolist()[0] for i in field.data]
        elif kind == kinds.STRING:
            metadata[name] = bytes(field.parts[field.data[0]]).decode("utf-8")
        else:
            metadata[name] = field.parts[field.data[0]].tolist()[0]
    return metadata, tuple(t.name for t in reader.tensors)


def smol_tokenizer(gguf_path):
    stand_in = types.ModuleType("transformers.integrations.gguf.reader")
    stand_in.read_gguf_metadata = read_gguf_metadata
    sys.modules["transformers.integrations.gguf.reader"] = stand_in
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder, name = os.path.split(os.path.abspath(gguf_path))
    tok = PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    # The same ids as transformers' full GGUF path gave make_golden.py.
    for t in json.loads(SMOL_GOLDEN.read_text())["texts"]:
        ids = tok(t["text"], add_special_tokens=False)["input_ids"]
        assert ids == t["ids"], f"the tokenizer differs from smollm2.json's on {t['text']!r}"
    return tok


# --- vLLM 0.34's conversion of OpenAI messages ---------------------------------------------


def vllm_messages(messages):
    """The request's messages as vLLM 0.34 hands them to `apply_chat_template`.

    vllm/entrypoints/openai/chat_completion/protocol.py, `_normalize_messages_before`: a
    message's `reasoning_content` is renamed `reasoning` (unless it has `reasoning`).
    vllm/renderers/chat_utils/chat_message.py, `parse_chat_message_content` (string content
    format, as these templates use): `content` becomes a string (null: "", text parts joined
    with "\\n"); an assistant keeps `tool_calls` (when not null) and passes `reasoning` as both
    `reasoning` and `reasoning_content`; a tool message keeps `tool_call_id`; a string `name`
    is kept. `_postprocess_messages`: an empty `tool_calls` list is dropped, and each
    `function.arguments` JSON string is parsed to an object (invalid JSON, a non-object, "" or
    null become {}).
    """
    out = []
    for msg in copy.deepcopy(messages):
        if msg.get("reasoning_content") is not None and msg.get("reasoning") is None:
            msg["reasoning"] = msg.pop("reasoning_content")
        msg.pop("reasoning_content", None)
        role, content = msg["role"], msg.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            content = "\n".join(p["text"] for p in content if p.get("type") == "text")
        conv = {"role": role, "content": content}
        if role == "assistant":
            if msg.get("tool_calls") is not None:
                conv["tool_calls"] = list(msg["tool_calls"])
            if msg.get("reasoning") is not None:
                conv["reasoning"] = msg["reasoning"]
                conv["reasoning_content"] = msg["reasoning"]
        elif role == "tool" and "tool_call_id" in msg:
            conv["tool_call_id"] = msg["tool_call_id"]
        if isinstance(msg.get("name"), str):
            conv["name"] = msg["name"]
        out.append(conv)
    for conv in out:  # _postprocess_messages
        if conv["role"] != "assistant" or "tool_calls" not in conv:
            continue
        if len(conv["tool_calls"]) == 0:
            del conv["tool_calls"]
            continue
        for call in conv["tool_calls"]:
            fn = call["function"]
            args = fn.get("arguments")
            if not args:
                fn["arguments"] = {}
            elif isinstance(args, str):
                try:
                    parsed = json.loads(args)
                except json.JSONDecodeError:
                    parsed = None
                fn["arguments"] = parsed if isinstance(parsed, dict) else {}
    return out


# --- the requests -----------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city — température, vent & ciel (<10 min old)",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Zürich or 東京"},
                    "unit": {
                        "type": "string",
                        "enum": ["celsius", "fahrenheit"],
                        "description": "Temperature unit ('celsius' unless asked)",
                    },
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_flights",
            "description": "Search flights between two airports; returns up to 5 offers",
            "parameters": {
                "type": "object",
                "properties": {
                    "route": {
                        "type": "object",
                        "description": "Where from and where to",
                        "properties": {
                            "from": {"type": "string", "description": "IATA code"},
                            "to": {"type": "string", "description": "IATA code"},
                        },
                        "required": ["from", "to"],
                    },
                    "passengers": {"type": "integer", "description": "How many travel"},
                    "filters": {
                        "type": "array",
                        "description": "Each filter narrows the offers",
                        "items": {
                            "type": "object",
                            "properties": {
                                "airline": {"type": "string"},
                                "max_stops": {"type": "integer", "minimum": 0},
                            },
                        },
                    },
                    "max_price": {"type": ["number", "integer"], "description": "In CHF"},
                    "extras": {
                        "type": "object",
                        "description": "Options by name",
                        "additionalProperties": {"type": "boolean"},
                    },
                },
                "required": ["route", "passengers"],
            },
        },
    },
]

NULLABLE_TOOL = {
    "type": "function",
    "function": {
        "name": "note",
        "description": "Keep a note",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": ["string", "null"], "description": "The note"}},
        },
    },
}

SYSTEM = {"role": "system", "content": "You are a travel assistant. Réponds brièvement."}
USER1 = {
    "role": "user",
    "content": "What's the weather in Zürich, and are there flights ZRH → Tokyo for 2?",
}
USER2 = {"role": "user", "content": "Thanks! And tomorrow?"}

WEATHER_ARGS = '{"city": "Zürich", "unit": "celsius"}'
FLIGHT_ARGS = (
    '{"route": {"to": "NRT", "from": "ZRH"}, "passengers": 2, '
    '"filters": [{"airline": "LX", "max_stops": 0}], "max_price": 1250.5, '
    '"notes": "window seat, l\'avion de nuit <3 & \\u00e9t\\u00e9"}'
)


def call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_result(call_id, content):
    return {"role": "tool", "tool_call_id": call_id, "content": content}


WEATHER_CALL = call("call_w1", "get_weather", WEATHER_ARGS)
FLIGHT_CALL = call("call_f1", "search_flights", FLIGHT_ARGS)
WEATHER_RESULT = tool_result("call_w1", '{"temperature": 21.5, "condition": "sunny"}')
FLIGHT_RESULT = tool_result("call_f1", '[{"flight": "LX 160", "price": 1180}]')
FINAL = {"role": "assistant", "content": "21.5 °C and sunny. LX 160 costs 1180 CHF."}


def request(messages, tools=None, gen=True, kwargs=None):
    req = {"messages": messages, "add_generation_prompt": gen}
    if tools is not None:
        req["tools"] = tools
    if kwargs:
        req["chat_template_kwargs"] = kwargs
    return req


def cases_for(template):
    """(name, request) for every case of one template."""
    llama = template == LLAMA31
    kw = {"date_string": DATE_STRING} if llama else None
    one_call = [
        SYSTEM,
        USER1,
        {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]},
        WEATHER_RESULT,
        FINAL,
        USER2,
    ]
    two_calls = [
        SYSTEM,
        USER1,
        {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL, FLIGHT_CALL]},
        WEATHER_RESULT,
        FLIGHT_RESULT,
        FINAL,
        USER2,
    ]
    content_and_call = [
        USER1,
        {"role": "assistant", "content": "Let me check the weather first.", "tool_calls": [WEATHER_CALL]},
        {
            "role": "tool",
            "tool_call_id": "call_w1",
            "content": [{"type": "text", "text": "21.5 °C"}, {"type": "text", "text": "sunny"}],
        },
    ]
    coerced = [
        USER1,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call("call_x", "get_weather", '{"city": "Zür')],
        },
        tool_result("call_x", "error: bad arguments"),
    ]
    null_and_empty = [
        SYSTEM,
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! ", "tool_calls": None},
        {"role": "user", "content": "  Plan a trip?  "},
        {"role": "assistant", "content": "Sure.", "tool_calls": []},
        USER2,
    ]
    out = [
        ("tools-system-user-gen", request([SYSTEM, USER1], TOOLS, True, kw)),
        ("tools-system-user-nogen", request([SYSTEM, USER1], TOOLS, False, kw)),
        ("tools-user-gen", request([USER1], TOOLS, True, kw)),
        ("one-call-then-user", request(one_call, TOOLS, True, kw)),
        ("two-calls-then-user", request(two_calls, TOOLS, True, kw)),
        ("content-and-call", request(content_and_call, TOOLS, True, kw)),
        ("content-and-call-nogen", request(content_and_call, TOOLS, False, kw)),
        ("arguments-not-json", request(coerced, TOOLS, True, kw)),
        ("no-tools", request(null_and_empty, None, True, kw)),
        # Hermes' json_to_python_type recurses without end on a type it does not know
        # ("null"): transformers stops at Python's recursion limit, and ferry must stop too.
        ("nullable-parameter", request([USER1], [NULLABLE_TOOL], True, kw)),
        ("no-tools-nogen", request(null_and_empty, None, False, kw)),
    ]
    if not llama:
        odd_args = [
            USER1,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [call("call_a", "get_weather", "[1, 2]"), call("call_b", "get_weather", "")],
            },
            tool_result("call_a", "a"),
            tool_result("call_b", "b"),
        ]
        out.append(("arguments-array-and-empty", request(odd_args, TOOLS, True, kw)))
    if template == QWEN3:
        reasoned = {
            "role": "assistant",
            "content": None,
            "reasoning": "\nThe user wants weather first.\n",
            "tool_calls": [WEATHER_CALL],
        }
        aliased = dict(reasoned, reasoning_content=reasoned["reasoning"])
        del aliased["reasoning"]
        out += [
            ("reasoning-after-last-query", request([SYSTEM, USER1, reasoned, WEATHER_RESULT], TOOLS)),
            (
                "reasoning-content-name",
                request([SYSTEM, USER1, aliased, WEATHER_RESULT], TOOLS),
            ),
            (
                "reasoning-thinking-off",
                request([SYSTEM, USER1, reasoned, WEATHER_RESULT], TOOLS, True, {"enable_thinking": False}),
            ),
            (
                "reasoning-before-last-query",
                request(
                    [SYSTEM, USER1, reasoned, WEATHER_RESULT, dict(FINAL, reasoning="Sunny, say so."), USER2],
                    TOOLS,
                ),
            ),
            (
                "think-in-content",
                request(
                    [
                        USER1,
                        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nIt is sunny."},
                        USER2,
                    ],
                    None,
                    True,
                    {"enable_thinking": False},
                ),
            ),
        ]
    return out


# --- rendering --------------------------------------------------------------------------------


def render(tok, template_text, req):
    """`(text, ids)` as transformers renders the request after vLLM's conversion, or
    `(None, error)` when the template raises."""
    kwargs = dict(req.get("chat_template_kwargs") or {})
    common = dict(
        tools=req.get("tools"),
        chat_template=template_text,
        add_generation_prompt=req["add_generation_prompt"],
        **kwargs,
    )
    try:
        text = tok.apply_chat_template(vllm_messages(req["messages"]), tokenize=False, **common)
        ids = tok.apply_chat_template(
            vllm_messages(req["messages"]), tokenize=True, return_dict=False, **common
        )
    except Exception as e:  # vLLM answers any of these with a 400
        return None, f"{type(e).__name__}: {e}"
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    return text, ids


def first_difference(a, b):
    """The first index where the sequences differ (the shorter's length if one is a prefix of
    the other), or None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# --- every turn's tokens ----------------------------------------------------------------------

# The model's own tokenizers, for the boundary question only: their pre-tokenizer split
# (transformers' copies of the Qwen2 and Llama 3 regexes) and special tokens that appear at
# the joins (Qwen3's <think>, </think>, <tool_call> are added tokens in its tokenizer.json;
# Llama 3.1's header, end-of-turn and python tokens are special; Hermes 3 renamed two reserved
# Llama 3.1 tokens to <|im_start|> and <|im_end|>).
OWN_TOKENIZERS = {
    QWEN3: (
        "qwen2",
        ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
         "<tool_response>", "</tool_response>", "<|endoftext|>"],
    ),
    LLAMA31: (
        "llama3",
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
         "<|eom_id|>", "<|python_tag|>"],
    ),
    HERMES3: ("llama3", ["<|begin_of_text|>", "<|im_start|>", "<|im_end|>"]),
}


def own_pieces(template, text):
    """The text cut as the model's own tokenizer cuts it before BPE: at its special tokens,
    then by its pre-tokenizer regex. BPE merges never cross these cuts."""
    from tokenizers import Regex, pre_tokenizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    regex, specials = OWN_TOKENIZERS[template]
    split = pre_tokenizers.Split(Regex(GGUF_PRE_TOKENIZER_SPLITS[regex]), behavior="isolated")
    pattern = "(" + "|".join(re.escape(s) for s in specials) + ")"
    pieces = []
    for part in re.split(pattern, text):
        if part in specials:
            pieces.append(part)
        elif part:
            pieces += [p for p, _ in split.pre_tokenize_str(part)]
    return pieces


def joins_clean(template, prompt, output, following):
    """Whether the model's own tokenizer cuts `prompt + output + following` at both joins."""
    whole = own_pieces(template, prompt + output + following)
    ends, at = set(), 0
    for p in whole:
        at += len(p)
        ends.add(at)
    return len(prompt) in ends and len(prompt + output) in ends


def weather_message(args_text, content=None, reasoning=None):
    msg = {
        "role": "assistant",
        "content": content,
        "tool_calls": [call("call_w1", "get_weather", args_text)],
    }
    if reasoning is not None:
        msg["reasoning"] = reasoning
    return msg


SPACED = '{"city": "Paris"}'
COMPACT = '{"city":"Paris"}'
PARIS_RESULT = tool_result("call_w1", "18 °C, cloudy")
USER_PARIS = {"role": "user", "content": "Weather in Paris?"}


def turn_variants():
    """(template, name, what, turn n's request, the model's output text, the message the API
    returns for it, what follows it in turn n+1, kwargs)."""
    qwen_call = lambda args: f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'
    hermes_call = qwen_call
    llama_call = lambda args: f'{{"name": "get_weather", "parameters": {args}}}'
    think = "<think>\nParis, so call get_weather.\n</think>\n\n"
    reasoning = "\nParis, so call get_weather.\n"
    base = [SYSTEM, USER_PARIS]
    off = {"enable_thinking": False}
    llama_kw = {"date_string": DATE_STRING}
    return [
        (QWEN3, "qwen3-thinking-content-as-parsed",
         "thinking on; the API returns the reasoning and, as vLLM's hermes tool parser does, the "
         "text between </think> and <tool_call> (\"\\n\\n\") as content",
         base, think + qwen_call(SPACED) + "<|im_end|>",
         weather_message(SPACED, content="\n\n", reasoning=reasoning), [PARIS_RESULT], None),
        (QWEN3, "qwen3-thinking-content-null",
         "thinking on; reasoning returned, whitespace-only content returned as null",
         base, think + qwen_call(SPACED) + "<|im_end|>",
         weather_message(SPACED, content=None, reasoning=reasoning), [PARIS_RESULT], None),
        (QWEN3, "qwen3-thinking-compact-arguments",
         "thinking on, content null; the model wrote its arguments without spaces",
         base, think + qwen_call(COMPACT) + "<|im_end|>",
         weather_message(COMPACT, content=None, reasoning=reasoning), [PARIS_RESULT], None),
        (QWEN3, "qwen3-thinking-off",
         "enable_thinking false: the prompt ends in an empty <think></think> block; no reasoning",
         base, qwen_call(SPACED) + "<|im_end|>",
         weather_message(SPACED), [PARIS_RESULT], off),
        (QWEN3, "qwen3-thinking-then-user",
         "thinking on, a plain answer, then a new user message (not a tool result)",
         base, think + "It is 18 °C in Paris.<|im_end|>",
         {"role": "assistant", "content": "\n\nIt is 18 °C in Paris.", "reasoning": reasoning},
         [USER2], None),
        (HERMES3, "hermes-call",
         "the call in the template's own format, arguments with spaces",
         base, hermes_call(SPACED) + "<|im_end|>", weather_message(SPACED), [PARIS_RESULT], None),
        (HERMES3, "hermes-compact-arguments",
         "arguments without spaces",
         base, hermes_call(COMPACT) + "<|im_end|>", weather_message(COMPACT), [PARIS_RESULT], None),
        (HERMES3, "hermes-text-before-call",
         "the model writes a sentence before the call (returned as content)",
         base, "Let me check.\n" + hermes_call(SPACED) + "<|im_end|>",
         weather_message(SPACED, content="Let me check.\n"), [PARIS_RESULT], None),
        (HERMES3, "hermes-arguments-first",
         "the model writes \"arguments\" before \"name\"",
         base, '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call><|im_end|>',
         weather_message(SPACED), [PARIS_RESULT], None),
        (LLAMA31, "llama-call",
         "the JSON call format with spaces, then <|eot_id|>",
         base, llama_call(SPACED) + "<|eot_id|>", weather_message(SPACED), [PARIS_RESULT], llama_kw),
        (LLAMA31, "llama-compact-arguments",
         "arguments without spaces",
         base, llama_call(COMPACT) + "<|eot_id|>", weather_message(COMPACT), [PARIS_RESULT], llama_kw),
        (LLAMA31, "llama-answer-then-user",
         "a plain answer, then a new user message",
         base, "It is 18 °C in Paris.<|eot_id|>",
         {"role": "assistant", "content": "It is 18 °C in Paris."}, [USER2], llama_kw),
    ]


def turn_golden(tok, sources):
    out = []
    for template, name, what, base, output, message, following, kwargs in turn_variants():
        tools = [TOOLS[0]]
        turn_n = request(base, tools, True, kwargs)
        turn_next = request(base + [message] + following, tools, True, kwargs)
        prompt_text, prompt_ids = render(tok, sources[template], turn_n)
        next_text, next_ids = render(tok, sources[template], turn_next)
        assert prompt_text is not None and next_text is not None, name
        output_ids = tok(output, add_special_tokens=False)["input_ids"]
        joined_text = prompt_text + output
        joined_ids = prompt_ids + output_ids
        text_at = first_difference(joined_text, next_text[: len(joined_text)])
        ids_at = first_difference(joined_ids, next_ids[: len(joined_ids)])
        entry = {
            "name": name,
            "template": template,
            "what": what,
            "turn": turn_n,
            "turn_json": body(turn_n),
            "prompt_text": prompt_text,
            "prompt_ids": prompt_ids,
            "output_text": output,
            "output_ids": output_ids,
            "assistant_message": message,
            "next_turn": turn_next,
            "next_turn_json": body(turn_next),
            "next_text": next_text,
            "next_ids": next_ids,
            "text_prefix": text_at is None,
            "ids_prefix": ids_at is None,
            "ids_first_difference": ids_at,
        }
        if text_at is not None:
            entry["text_first_difference"] = {
                "at": text_at,
                "expected": joined_text[max(0, text_at - 20) : text_at + 30],
                "rendered": next_text[max(0, text_at - 20) : text_at + 30],
            }
        else:
            following_text = next_text[len(joined_text) :]
            entry["own_tokenizer_joins_clean"] = joins_clean(template, prompt_text, output, following_text)
        if ids_at is not None:
            entry["ids_around_difference"] = {
                "expected": joined_ids[max(0, ids_at - 3) : ids_at + 5],
                "rendered": next_ids[max(0, ids_at - 3) : ids_at + 5],
            }
        out.append(entry)
    return out


# --- output -----------------------------------------------------------------------------------


def dump(golden):
    """The golden as JSON: its head indented, each case and turn on one line."""
    head = {k: v for k, v in golden.items() if k not in ("cases", "turns")}
    text = json.dumps(head, ensure_ascii=False, indent=1)[:-2]
    for key in ("cases", "turns"):
        lines = [" " + json.dumps(item, ensure_ascii=False) for item in golden[key]]
        text += f',\n "{key}": [\n' + ",\n".join(lines) + "\n ]"
    return text + "\n}"


def body(req):
    """A request's JSON text, as the test sends it: verbatim, so the keys keep the order
    transformers saw (a client's order; the test's own serde_json may sort them)."""
    return json.dumps(req, ensure_ascii=False)


def sha256(path):
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def main():
    cache = os.environ.get("FERRY_CACHE") or os.path.join(os.path.expanduser("~"), ".cache/ferry")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=os.path.join(cache, "models", MODEL_FILE))
    args = parser.parse_args()

    import jinja2
    import tokenizers
    import transformers

    found = {
        "transformers": transformers.__version__,
        "jinja2": jinja2.__version__,
        "tokenizers": tokenizers.__version__,
        "gguf": __import__("importlib.metadata").metadata.version("gguf"),
    }
    if found != PINS:
        sys.exit(f"pinned versions {PINS}, found {found}: see the docstring")

    tok = smol_tokenizer(args.gguf)
    sources = {name: (FIXTURES / name).read_text() for name in TEMPLATES}
    cases = []
    for template in TEMPLATES:
        for name, req in cases_for(template):
            text, ids = render(tok, sources[template], req)
            case = {
                "name": f"{SHORT[template]}/{name}",
                "template": template,
                "request": req,
                "request_json": body(req),
            }
            if text is None:
                case["error"] = ids
            else:
                case["text"] = text
                case["ids"] = ids
            cases.append(case)
    golden = {
        "about": (
            "Chat templates rendered by transformers' apply_chat_template after vLLM 0.34's "
            "message conversion, tokenized with SmolLM2-135M-Instruct's tokenizer (from its GGUF); "
            "made by scripts/golden/make_chat_templates.py, read by crates/ferry/tests/chat_templates.rs"
        ),
        "versions": found,
        "model_file": os.path.basename(args.gguf),
        "model_sha256": sha256(args.gguf),
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "date_string": DATE_STRING,
        "templates": {name: {"sha256": sha256(FIXTURES / name)} for name in TEMPLATES},
        "cases": cases,
        "turns": turn_golden(tok, sources),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(dump(golden) + "\n")
    errors = sum("error" in c for c in cases)
    print(f"{OUT.relative_to(ROOT)}: {len(cases)} cases ({errors} errors), {len(golden['turns'])} turns")
    for t in golden["turns"]:
        print(
            f"  {t['name']}: text prefix {t['text_prefix']}, SmolLM2 ids prefix {t['ids_prefix']}"
            + (f", own tokenizer's joins clean {t['own_tokenizer_joins_clean']}" if t["text_prefix"] else "")
        )


if __name__ == "__main__":
    main()
