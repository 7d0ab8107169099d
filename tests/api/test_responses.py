"""The Responses API against a real server on the default model, through the official
openai SDK with strict response validation: plain and streamed answers, function tools,
`text.format` schemas, conversations continued by `previous_response_id` from a bounded
store, and bad input refused naming the field."""

import json

import httpx
import jsonschema
import openai
import pytest

from conftest import NAME, Server

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": CITY, "strict": True}


@pytest.fixture(scope="module")
def strict(server):
    """An SDK client that validates every response against the SDK's own types."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120,
                         _strict_response_validation=True)


def test_a_plain_response_has_its_text_usage_and_is_stored(strict):
    r = strict.responses.create(model=NAME, input="Say hello.", instructions="Be brief.",
                                max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete")
    assert r.output_text and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.output_tokens <= 8 and r.usage.input_tokens > 5
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert strict.responses.retrieve(r.id).output_text == r.output_text


def test_greedy_responses_match_chat_completions(strict):
    """The same conversation gives the same text through both APIs."""
    r = strict.responses.create(model=NAME, input=[{"role": "user", "content": "Name a fruit."}],
                                instructions="Answer in one word.", max_output_tokens=12, temperature=0)
    c = strict.chat.completions.create(model=NAME, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a fruit."}])
    assert r.output_text == c.choices[0].message.content


def test_a_streamed_response_sends_the_event_sequence_and_the_same_text(strict):
    kwargs = dict(model=NAME, input="Count from one to five.", max_output_tokens=16, temperature=0)
    whole = strict.responses.create(**kwargs)
    events = list(strict.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], types
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", events[-1].type], types
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1
    # The SDK's own stream helper accepts the sequence of a response that completes.
    kwargs.update(input="Say OK.", max_output_tokens=64)
    whole = strict.responses.create(**kwargs)
    assert whole.status == "completed", whole
    with strict.responses.stream(**kwargs) as stream:
        assert stream.get_final_response().output_text == whole.output_text


def test_previous_response_id_continues_the_conversation(strict, server):
    first = strict.responses.create(model=NAME, input="My name is Ada. Say OK.", max_output_tokens=4,
                                    temperature=0)
    second = strict.responses.create(model=NAME, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id
    # The second prompt holds the first turn and its answer.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    chat = strict.chat.completions.create(model=NAME, max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "My name is Ada. Say OK."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert second.output_text == chat.choices[0].message.content
    unstored = strict.responses.create(model=NAME, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError) as e:
        strict.responses.create(model=NAME, input="again", previous_response_id=unstored.id)
    assert "store: false" in e.value.body["message"] and e.value.body["param"] == "previous_response_id"
    strict.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        strict.responses.retrieve(first.id)
    assert "deleted" in e.value.body["message"]


def test_an_evicted_response_is_named_as_evicted():
    s = Server("--max-stored-responses", "1")
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        old = c.responses.create(model=NAME, input="one", max_output_tokens=2)
        c.responses.create(model=NAME, input="two", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError) as e:
            c.responses.create(model=NAME, input="three", previous_response_id=old.id)
        assert "evicted" in e.value.body["message"] and "newest 1 responses" in e.value.body["message"]
        with pytest.raises(openai.NotFoundError) as e:
            c.responses.retrieve("resp_" + "0" * 40)
        assert "another replica" in e.value.body["message"]
    finally:
        s.stop()


def test_a_required_tool_call_validates_and_its_output_is_answered(strict):
    r = strict.responses.create(model=NAME, input="What's the weather in Paris?", tools=[WEATHER],
                                tool_choice="required", parallel_tool_calls=False, temperature=0,
                                max_output_tokens=60)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1, r.output
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), CITY)
    followup = strict.responses.create(
        model=NAME, previous_response_id=r.id, tools=[WEATHER], temperature=0, max_output_tokens=40,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}])
    assert followup.status in ("completed", "incomplete")
    assert followup.output_text or any(o.type == "function_call" for o in followup.output)
    # The same turn sent as items, as clients that keep their own history send it.
    items = strict.responses.create(model=NAME, tools=[WEATHER], temperature=0, max_output_tokens=40, input=[
        {"role": "user", "content": "What's the weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
         "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}])
    assert items.output_text == followup.output_text


def test_a_streamed_tool_call_sends_the_item_then_its_arguments_as_they_grow(strict):
    events = list(strict.responses.create(model=NAME, input="Weather in Rome?", tools=[WEATHER],
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          temperature=0, max_output_tokens=60, stream=True))
    types = [e.type for e in events]
    i = types.index("response.function_call_arguments.delta")
    assert types[i - 1] == "response.output_item.added" and events[i - 1].item.type == "function_call"
    assert events[i - 1].item.name == "get_weather"
    first = events[i - 1].item.id
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.item_id == first]
    done = events[types.index("response.function_call_arguments.done")]
    assert done.item_id == first
    assert len(deltas) > 2 and "".join(deltas) == done.arguments
    jsonschema.validate(json.loads(done.arguments), CITY)
    assert events[-1].response.output[0].arguments == done.arguments
    assert types[-1] == "response.completed"


def test_a_text_format_schema_is_met(strict):
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    for seed_prompt in ["Describe a person.", "Invent a pilot.", "Who wrote this?"]:
        r = strict.responses.create(model=NAME, input=seed_prompt, temperature=1.0, max_output_tokens=80,
                                    text={"format": {"type": "json_schema", "name": "person", "schema": person,
                                                     "strict": True}})
        assert r.status == "completed", r
        jsonschema.validate(json.loads(r.output_text), person)
        assert r.text.format.type == "json_schema"


def test_logprobs_come_with_the_text_when_included(strict):
    r = strict.responses.create(model=NAME, input="Hi", max_output_tokens=4, temperature=0, top_logprobs=2,
                                include=["message.output_text.logprobs"])
    part = r.output[0].content[0]
    assert len(part.logprobs) == r.usage.output_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in part.logprobs)


@pytest.mark.parametrize("body,param,words", [
    ({"input": [{"role": "narrator", "content": "x"}]}, "input", "narrator"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", "input_image"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "input_image"),
    ({"tools": [{"type": "web_search"}]}, "tools", "web_search"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "fly"}}, "tool_choice", "fly"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "banana"}}}},
     "text.format", "banana"),
    ({"background": True}, "background", "stream"),
    ({"truncation": "middle"}, "truncation", "auto"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id", "another replica"),
    ({"temprature": 0}, "temprature", "unrecognized"),
])
def test_bad_responses_input_is_a_400_naming_the_field(server, body, param, words):
    r = httpx.post(server.url + "/v1/responses", json={"model": NAME, "input": "hi", **body}, timeout=60)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"].startswith(param), err
    assert words in err["message"], err
