"""Starts real `ferrite-engine serve` processes on loopback for the API tests."""
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = os.environ.get("FERRITE_TEST_MODEL", str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
BIN = os.environ.get("FERRITE_BIN", str(ROOT / "target" / "release" / "ferrite-engine"))
NAME = "smollm2"
MAX_MODEL_LEN = 2048


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One engine process; `url` is its base URL."""

    def __init__(self, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(ROOT / "target" / f"api-server-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [BIN, "serve", "--model", MODEL, "--host", "127.0.0.1", "--port", str(self.port),
             "--served-model-name", NAME, "--max-model-len", str(MAX_MODEL_LEN),
             "--kv-cache-memory", "300000000", *extra],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 120
        while time.time() < deadline:
            assert self.proc.poll() is None, f"server exited early, see {self.log.name}"
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError("server did not become healthy")

    def metrics(self) -> dict:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        values = {}
        for line in text.splitlines():
            if line.startswith("vllm:") and " " in line:
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def output(self) -> str:
        """What the process has logged so far."""
        self.log.flush()
        return (ROOT / "target" / f"api-server-{self.port}.log").read_text()

    def stop(self, sig=signal.SIGTERM, timeout=60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.log.close()


@pytest.fixture(scope="session")
def server():
    s = Server()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    return server.client()
