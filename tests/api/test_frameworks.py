"""The frameworks agents are built with, unchanged, against a real server on the default
model: LangChain's tool binding and structured output, the openai-agents SDK running an
agent with a function tool over chat completions and over the Responses API, and
LiteLLM. Nothing here reaches the internet: tracing and LiteLLM's price-list fetch are off."""

import asyncio
import json
import os

import jsonschema
import pytest
from pydantic import BaseModel, Field

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")

import agents  # noqa: E402
import litellm  # noqa: E402
from langchain_core.messages import ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402

from conftest import NAME  # noqa: E402

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"sunny and 21 C in {city}"


class Person(BaseModel):
    """A person."""
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def llm(server):
    return ChatOpenAI(model=NAME, base_url=server.url + "/v1", api_key="unused", max_retries=0,
                      temperature=0, max_tokens=80, timeout=120)


@pytest.mark.parametrize("choice", ["get_weather", "required", "any"])
def test_langchain_bind_tools_returns_a_call_whose_arguments_validate(llm, choice):
    reply = llm.bind_tools([get_weather], tool_choice=choice).invoke("What's the weather in Paris?")
    assert reply.tool_calls, reply
    call = reply.tool_calls[0]
    assert call["name"] == "get_weather" and call["id"]
    jsonschema.validate(call["args"], CITY)
    # The tool's result sent back is accepted and answered.
    result = ToolMessage(content=get_weather.invoke(call["args"]), tool_call_id=call["id"])
    answer = llm.bind_tools([get_weather]).invoke(
        [("user", "What's the weather in Paris?"), reply, result])
    assert answer.content or answer.tool_calls


def test_langchain_structured_output_returns_the_pydantic_object(llm):
    for method in ("json_schema", "function_calling"):
        person = llm.with_structured_output(Person, method=method).invoke("Describe a person.")
        assert isinstance(person, Person), (method, person)


def test_langchain_streams_plain_chat(llm):
    chunks = [c.content for c in llm.stream("Say hello.")]
    assert len(chunks) > 1 and "".join(chunks)


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_an_openai_agents_agent_calls_its_function_tool(server, api):
    calls = []

    @agents.function_tool
    def weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"sunny and 21 C in {city}"

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = (agents.OpenAIChatCompletionsModel(NAME, client) if api == "chat_completions"
             else agents.OpenAIResponsesModel(NAME, client))
    # The first turn must call the tool; later turns may answer (the SDK resets the choice).
    settings = agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=80)
    agent = agents.Agent(name="forecaster", instructions="Answer questions about the weather.",
                         model=model, tools=[weather], model_settings=settings)

    async def run():
        result = await agents.Runner.run(agent, "What's the weather in Paris?", max_turns=4)
        streamed = agents.Runner.run_streamed(agent, "What's the weather in Oslo?", max_turns=4)
        async for _ in streamed.stream_events():
            pass
        return result, streamed

    try:
        result, streamed = asyncio.run(run())
    except agents.exceptions.MaxTurnsExceeded:
        # A small model may keep calling the tool; the calls are what this test is about.
        result = streamed = None
    assert len(calls) >= 2, calls
    assert all(isinstance(c, str) and c for c in calls)
    for r in (result, streamed):
        if r is not None:
            assert isinstance(r.final_output, str)


def test_litellm_completion_plain_streamed_and_with_tools(server):
    kw = dict(model="openai/" + NAME, api_base=server.url + "/v1", api_key="unused", num_retries=0,
              temperature=0, max_tokens=40)
    reply = litellm.completion(messages=[{"role": "user", "content": "Say hello."}], **kw)
    assert reply.choices[0].message.content
    text = "".join(c.choices[0].delta.content or "" for c in
                   litellm.completion(messages=[{"role": "user", "content": "Say hello."}], stream=True, **kw))
    assert text == reply.choices[0].message.content
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather.",
                                               "parameters": CITY}}]
    reply = litellm.completion(messages=[{"role": "user", "content": "Weather in Rome?"}], tools=tools,
                               tool_choice="required", **kw)
    call = reply.choices[0].message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), CITY)
    person = litellm.completion(messages=[{"role": "user", "content": "Describe a person."}],
                                response_format=Person, **{**kw, "max_tokens": 80})
    Person.model_validate_json(person.choices[0].message.content)
