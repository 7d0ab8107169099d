"""The client snippets in examples/clients/ run unchanged against a real server."""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import NAME, ROOT

CLIENTS = ROOT / "examples" / "clients"


def run(cmd: list[str], server) -> str:
    env = dict(os.environ, FERRITE_URL=server.url, MODEL=NAME)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_curl_snippet(server):
    out = run(["bash", str(CLIENTS / "curl.sh")], server)
    models, chat, stream = out.split("\n", 2)
    assert json.loads(models)["data"][0]["id"] == NAME
    reply = json.loads(chat)
    assert reply["object"] == "chat.completion"
    assert reply["choices"][0]["message"]["content"]
    events = [line[6:] for line in stream.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])
    assert text


def test_openai_python_snippet(server):
    out = run([sys.executable, str(CLIENTS / "chat.py")], server)
    lines = out.strip().splitlines()
    assert len(lines) >= 3, out
    assert "prompt +" in out and "completion tokens" in out
    assert lines[-1].strip(), "the streamed answer is empty"
