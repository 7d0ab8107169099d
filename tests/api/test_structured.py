"""Structured output and tool calling against a real server on the default model: a
requested schema is always met, tool calls come back in OpenAI's shape (whole and
streamed), and bad input is a 400 naming the field."""

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from conftest import NAME

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}

TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}

PROMPTS = [
    "Describe a person.",
    "Invent a user of our website.",
    "Who is the administrator?",
    "Write JSON about my grandmother.",
    "Tell me a joke.",
    "What is 2 + 2?",
    "List three colours.",
    "Give me a guest profile.",
]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def chat(server, **body) -> dict:
    r = post(server, "/v1/chat/completions", {"model": NAME, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_json_schema_is_met_for_every_prompt_and_seed(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def one(case):
        prompt, seed = case
        reply = chat(server, messages=[{"role": "user", "content": prompt}], response_format=fmt,
                     temperature=1.0, seed=seed, max_tokens=120)
        return prompt, seed, reply["choices"][0]

    cases = [(p, s) for p in PROMPTS for s in (1, 2, 3)]
    with ThreadPoolExecutor(8) as pool:
        for prompt, seed, choice in pool.map(one, cases):
            assert choice["finish_reason"] == "stop", (prompt, seed, choice)
            jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


def test_json_object_mode_and_the_structured_outputs_extras(server):
    reply = chat(server, messages=[{"role": "user", "content": "Describe a cat as JSON."}],
                 response_format={"type": "json_object"}, temperature=0, max_tokens=200)
    content = reply["choices"][0]["message"]["content"]
    if reply["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict), content
    else:
        assert content.startswith("{"), content
    reply = chat(server, messages=[{"role": "user", "content": "Is the sky blue?"}],
                 structured_outputs={"choice": ["yes", "no", "maybe"]}, temperature=1.0, seed=3)
    assert reply["choices"][0]["message"]["content"] in ("yes", "no", "maybe")
    r = post(server, "/v1/completions", {"model": NAME, "prompt": "The date today is",
                                         "structured_outputs": {"regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}"},
                                         "max_tokens": 20, "temperature": 0})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert len(text) == 10 and text[4] == "-" and text[7] == "-" and text.replace("-", "").isdigit(), text


def test_a_constrained_request_gives_the_same_tokens_alone_and_beside_fifteen_others(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    body = {"messages": [{"role": "user", "content": "Describe a person."}], "response_format": fmt,
            "temperature": 0, "max_tokens": 40, "logprobs": True}

    def tokens(reply):
        return [t["token"] for t in reply["choices"][0]["logprobs"]["content"]]

    alone = tokens(chat(server, **body))
    # The test binary is unoptimized: the others are short, but share the constrained
    # request's first steps.
    others = {"messages": [{"role": "user", "content": "Write a long story about the sea."}],
              "max_tokens": 10, "temperature": 0}
    with ThreadPoolExecutor(16) as pool:
        busy = [pool.submit(chat, server, **others) for _ in range(15)]
        beside = pool.submit(chat, server, **body)
        assert tokens(beside.result()) == alone
        for b in busy:
            b.result()


def test_required_and_named_tool_choices_always_give_calls_whose_arguments_validate(server):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for choice, seed in [("required", 1), ("required", 2),
                         ({"type": "function", "function": {"name": "get_time"}}, 1)]:
        reply = chat(server, messages=[{"role": "user", "content": "What's the weather in Paris?"}],
                     tools=[WEATHER, TIME], tool_choice=choice, temperature=0.8, seed=seed, max_tokens=150)
        c = reply["choices"][0]
        assert c["finish_reason"] == "tool_calls", c
        calls = c["message"]["tool_calls"]
        assert calls and c["message"]["content"] is None
        for call in calls:
            assert call["type"] == "function" and call["id"].startswith("call_")
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
        if isinstance(choice, dict):
            assert {call["function"]["name"] for call in calls} == {"get_time"}


def test_a_tool_result_is_accepted_and_answered(server):
    messages = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    reply = chat(server, messages=messages, tools=[WEATHER], temperature=0, max_tokens=60)
    c = reply["choices"][0]
    assert c["finish_reason"] in ("stop", "tool_calls", "length"), c
    assert c["message"]["content"] or c["message"].get("tool_calls")
    # Without tools the same conversation is plain chat.
    reply = chat(server, messages=messages, temperature=0, max_tokens=20)
    assert reply["choices"][0]["message"]["content"] is not None


def test_a_streamed_tool_call_sends_its_name_first_then_its_arguments_as_they_grow(server):
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120, json={
        "model": NAME, "messages": [{"role": "user", "content": "Weather in Rome?"}],
        "tools": [WEATHER], "tool_choice": "required", "stream": True, "temperature": 0,
        "max_tokens": 150}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    # The arguments arrive as they are written, not in one piece at the end.
    assert len(calls) > 3 and all("name" not in c["function"] for c in calls[1:]), calls
    args = "".join(c["function"]["arguments"] for c in calls)
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_tool_choice_answers_in_text_or_with_a_valid_call(server):
    for prompt in ["Hello, how are you?", "What's the weather in Oslo in celsius?"]:
        reply = chat(server, messages=[{"role": "user", "content": prompt}], tools=[WEATHER],
                     temperature=0, max_tokens=150)
        c = reply["choices"][0]
        if c["finish_reason"] == "tool_calls":
            for call in c["message"]["tool_calls"]:
                jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
        else:
            assert isinstance(c["message"]["content"], str)


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "banana"}}}},
     "response_format", "banana"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"structured_outputs": {"regex": "(", "choice": ["a"]}}, "structured_outputs", "regex and choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "fly"}}},
     "tool_choice", "fly"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"tool_choice": "required"}, "tool_choice", "lists none"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "function"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]},
     "messages", "tool_call_id"),
    ({"temperatur": 0.5}, "temperatur", "unrecognized"),
])
def test_bad_structured_and_tool_input_is_a_400_naming_the_field(server, body, param, words):
    r = post(server, "/v1/chat/completions",
             {"model": NAME, "messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith(param), err
    assert words in err["message"], err


def test_fields_that_change_nothing_are_accepted_and_ignored(server):
    reply = chat(server, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
                 store=False, metadata={"team": "a"}, service_tier="auto", user="u1",
                 reasoning_effort="low", prompt_cache_key="k", parallel_tool_calls=True)
    assert reply["choices"][0]["message"]["content"] is not None
    assert "ignoring request field `metadata`" in server.output()


def test_structured_requests_and_tool_calls_are_counted(server):
    chat(server, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
         tool_choice="required", temperature=0, max_tokens=60)
    with httpx.Client() as c:
        text = c.get(server.url + "/metrics").text
    assert 'ferrite:structured_output_requests_total{kind="grammar"' in text
    assert "ferrite:tool_calls_total" in text
