"""Naive Hugging Face Transformers serving: the baseline vLLM's speedups are quoted against.

Loads the same GGUF through transformers (dequantised to fp32, as transformers does) and
answers one request at a time with `model.generate` — no batching, no paged cache. It speaks
just enough of the OpenAI and vLLM APIs for ferrite-bench: `POST /tokenize`
(`{"prompt"}` -> `{"tokens"}`), `POST /v1/completions` (token-id prompt, `max_tokens`,
`ignore_eos`, `stream`; greedy) and `GET /health`.

    python scripts/hf_server.py --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf --port 8001
"""

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

LOCK = threading.Lock()  # one request at a time: the naive baseline


class SSEStreamer(BaseStreamer):
    """Writes one SSE chunk per generated token (generate's first put is the prompt)."""

    def __init__(self, write, model_name):
        self.write, self.model, self.prompt_seen, self.count = write, model_name, False, 0

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for tok in value.reshape(-1).tolist():
            self.count += 1
            chunk = {"object": "text_completion", "model": self.model,
                     "choices": [{"index": 0, "text": TOKENIZER.decode([tok]) or " ",
                                  "finish_reason": None}]}
            self.write(f"data: {json.dumps(chunk)}\n\n")

    def end(self):
        pass


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def send_json(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            self.send_json(200, {"status": "ok"})
        else:
            self.send_json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/tokenize":
            ids = TOKENIZER.encode(req.get("prompt", ""), add_special_tokens=False)
            return self.send_json(200, {"tokens": ids, "count": len(ids)})
        if self.path != "/v1/completions":
            return self.send_json(404, {"error": {"message": f"no route {self.path}"}})
        prompt = req["prompt"]
        ids = prompt if isinstance(prompt, list) else TOKENIZER.encode(prompt)
        n = int(req.get("max_tokens", 16))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def write(text):
            data = text.encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        streamer = SSEStreamer(write, req.get("model", ARGS.name))
        with LOCK, torch.inference_mode():
            MODEL.generate(torch.tensor([ids]), max_new_tokens=n,
                           min_new_tokens=n if req.get("ignore_eos") else 0,
                           do_sample=False, streamer=streamer,
                           pad_token_id=TOKENIZER.eos_token_id)
        usage = {"prompt_tokens": len(ids), "completion_tokens": streamer.count,
                 "total_tokens": len(ids) + streamer.count}
        write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n")
        write("data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")


def main():
    global ARGS, MODEL, TOKENIZER
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--name", default="smollm2")
    p.add_argument("--threads", type=int, default=2)
    ARGS = p.parse_args()
    torch.set_num_threads(ARGS.threads)
    path = Path(ARGS.gguf).resolve()
    started = time.time()
    TOKENIZER = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    MODEL = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    print(f"loaded {path.name} in {time.time() - started:.1f} s (fp32, {ARGS.threads} threads)",
          flush=True)
    ThreadingHTTPServer(("127.0.0.1", ARGS.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
