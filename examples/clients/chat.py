"""Calls a Ferrite endpoint with the official OpenAI Python SDK (pip install openai).

    kubectl port-forward svc/smollm2 8000:8000 &
    python chat.py                      # FERRITE_URL and MODEL override the defaults

Ferrite serves the OpenAI API, so any OpenAI client works; no API key is checked.
"""

import os

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("FERRITE_URL", "http://localhost:8000") + "/v1",
    api_key=os.environ.get("OPENAI_API_KEY", "unused"),
)
model = os.environ.get("MODEL", "smollm2")

reply = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Name three primary colors."}],
    max_tokens=32,
    temperature=0,
)
print(reply.choices[0].message.content)
print(f"({reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} completion tokens)")

# Streamed: tokens print as the engine produces them.
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Count from one to five."}],
    max_tokens=32,
    stream=True,
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
print()
