"""Model-parallel groups as processes: `serve --pipeline-parallel-size 2` and
`serve --tensor-parallel-size 3` starting their own ranks on one host, and two hosts' worth
of ranks (`--nnodes 2 --node-rank 0/1`, `--headless`) on loopback. They serve one
process's tokens and log-probabilities, each rank holds about its share of the weights, a
wrong secret is refused at the handshake, and a lost rank ends every in-flight request with
an error and fails `/health`, with nothing left running."""
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import BIN, MAX_MODEL_LEN, MODEL, NAME, ROOT, Server, free_port

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "The quick brown fox",
    "Once upon a time",
]


def complete(url: str, prompt: str, max_tokens: int = 24) -> dict:
    body = json.dumps({"model": NAME, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "logprobs": 2, "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        choice = json.loads(r.read())["choices"][0]
    return {"text": choice["text"], "logprobs": choice["logprobs"]}


def all_at_once(url: str) -> list:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: complete(url, p), PROMPTS))


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def wait_for(predicate, what: str, timeout: float = 120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise TimeoutError(what)


def children(pid: int) -> list:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def rss_bytes(pid: int) -> int:
    """Resident anonymous memory (the weights, caches and buffers; not the mapped binary)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no RssAnon for {pid}")


def one_process_rss() -> int:
    """The resident memory of one fresh, idle process serving the whole model."""
    whole = Server()
    try:
        return rss_bytes(whole.proc.pid)
    finally:
        whole.stop()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def counter(url: str, name: str, label: str) -> float:
    """The value of series `name` with `label` in `url`'s /metrics (-1 when absent)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    return -1.0


class Rank:
    """One `serve` process started by hand with `args`; `url` serves its HTTP."""

    def __init__(self, *args: str, env=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = ROOT / "target" / f"pipeline-rank-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [BIN, "serve", "--model", MODEL, "--host", "127.0.0.1", "--port", str(self.port),
             "--served-model-name", NAME, "--max-model-len", str(MAX_MODEL_LEN),
             "--kv-cache-memory", "300000000", "--pipeline-parallel-size", "2", *args],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def reference(server):
    return all_at_once(server.url)


def test_two_local_stages_serve_one_processes_tokens_each_holding_its_share(reference):
    # Memory first, every process idle and fresh: one process holds every layer; each rank
    # its half of the layers and one vocabulary-sized matrix (the tied embedding is the
    # first stage's input and the last stage's output).
    whole_rss = one_process_rss()
    group = Server("--pipeline-parallel-size", "2")
    try:
        [child] = children(group.proc.pid)
        weights = os.path.getsize(MODEL)
        for pid in (group.proc.pid, child):
            assert rss_bytes(pid) < whole_rss - 0.25 * weights, (pid, rss_bytes(pid), whole_rss)
        assert all_at_once(group.url) == reference
        assert counter(group.url, "ferrite:pipeline_stage_steps_total", 'stage="1"') > 0
        assert counter(group.url, "ferrite:pipeline_stage_transfer_seconds_total", 'stage="1"') != -1
        assert counter(group.url, "ferrite:tensor_parallel_collectives_total", 'stage="0"') == -1
        # The leader killed outright: the rank it started notices and exits.
        group.stop(signal.SIGKILL)
        wait_for(lambda: not alive(child), "the child rank outlived its leader", 20)
    finally:
        group.stop(signal.SIGKILL)


def stream_and_kill(url: str, kill) -> list:
    """A long streamed completion from `url`, calling `kill` after its fifth event: every
    event's data, to the end."""
    body = json.dumps({"model": NAME, "prompt": "Tell me a long story.", "max_tokens": 1500,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 5:
                threading.Thread(target=kill).start()
    return events


def assert_ended_by_error(events: list):
    assert len(events) > 5 and events[-1] == "[DONE]"
    # Not a finished completion: an error event, the server's fault, ends it.
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500, error
    assert not any('"finish_reason":"length"' in e for e in events)


def test_three_local_tensor_ranks_serve_one_processes_tokens_each_holding_its_share(reference):
    # The default model's 3 KV heads split into 3 ranks, each holding a third of every
    # matrix (the vocabulary's rows included): far less than the whole model.
    whole_rss = one_process_rss()
    group = Server("--tensor-parallel-size", "3")
    try:
        peers = children(group.proc.pid)
        assert len(peers) == 2, peers
        weights = os.path.getsize(MODEL)
        for pid in (group.proc.pid, *peers):
            assert rss_bytes(pid) < whole_rss - 0.5 * weights, (pid, rss_bytes(pid), whole_rss)
        assert all_at_once(group.url) == reference
        assert counter(group.url, "ferrite:tensor_parallel_collectives_total", 'stage="0"') > 0
        assert counter(group.url, "ferrite:tensor_parallel_collective_seconds_total", 'stage="0"') > 0
        # A tensor rank killed mid-stream: the request ends with an error, /health turns
        # 500, and the other rank stops too.
        events = stream_and_kill(group.url, lambda: os.kill(peers[1], signal.SIGKILL))
        assert_ended_by_error(events)
        wait_for(lambda: status(group.url) == 500, "the leader's /health did not turn 500", 20)
        wait_for(lambda: not alive(peers[0]), "a tensor rank outlived its group", 20)
        assert f"lost tensor rank 2 (pid {peers[1]})" in group.output()
    finally:
        group.stop(signal.SIGKILL)


def test_two_stages_of_two_tensor_ranks_each_serve_one_processes_tokens():
    # A tiny GQA model (2 KV heads): the leader starts stage 1, and each stage's rank 0 its
    # own tensor rank, so four processes serve, with a single process's tokens.
    tiny = str(ROOT / "tests" / "fixtures" / "tiny" / "tiny-Q4_K_M.gguf")
    flags = ("--model", tiny, "--max-model-len", "64")
    whole = Server(*flags)
    group = Server(*flags, "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2")
    try:
        ranks = children(group.proc.pid)
        assert len(ranks) == 2, ranks
        grandchildren = [c for pid in ranks for c in children(pid)]
        assert len(grandchildren) == 1, "stage 1 started its own tensor rank"
        ranks += grandchildren
        want = [complete(whole.url, p, 16) for p in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: complete(group.url, p, 16), PROMPTS))
        assert got == want
        assert counter(group.url, "ferrite:pipeline_stage_steps_total", 'stage="1"') > 0
    finally:
        whole.stop()
        group.stop()
    for pid in ranks:
        wait_for(lambda: not alive(pid), "a rank outlived its group", 20)


def test_tensor_ranks_exit_when_their_leader_is_killed():
    group = Server("--tensor-parallel-size", "3")
    try:
        peers = children(group.proc.pid)
        assert len(peers) == 2, peers
        group.stop(signal.SIGKILL)
        for pid in peers:
            wait_for(lambda: not alive(pid), "a tensor rank outlived its leader", 20)
    finally:
        group.stop(signal.SIGKILL)


def two_hosts(secret0="s3cret-group", secret1="s3cret-group", *extra):
    master = str(free_port())
    common = ("--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", master, *extra)
    leader = Rank(*common, "--node-rank", "0", env={"FERRITE_GROUP_SECRET": secret0})
    worker = Rank(*common, "--node-rank", "1", "--headless", env={"FERRITE_GROUP_SECRET": secret1})
    return leader, worker


def test_two_hosts_on_loopback_serve_the_same_and_a_lost_rank_fails_requests_and_health(reference):
    leader, worker = two_hosts()
    try:
        wait_for(lambda: status(leader.url) == 200 and status(worker.url) == 200,
                 "the group did not form:\n" + leader.output())
        assert all_at_once(leader.url) == reference
        assert_ended_by_error(stream_and_kill(leader.url, worker.kill))
        wait_for(lambda: status(leader.url) == 500, "the leader's /health did not turn 500", 20)
        assert "lost rank 1" in leader.output()
    finally:
        worker.kill()
        leader.kill()


def test_a_worker_told_to_stop_serves_until_its_leader_has_drained_and_ended_the_group(reference):
    # A LeaderWorkerSet group going away signals every pod at once; the leader drains its
    # requests, which needs every stage, so a worker stays until the leader ends the group.
    leader, worker = two_hosts()
    try:
        wait_for(lambda: status(leader.url) == 200 and status(worker.url) == 200,
                 "the group did not form:\n" + leader.output())
        worker.proc.send_signal(signal.SIGTERM)
        time.sleep(1)
        assert worker.proc.poll() is None, worker.output()
        assert all_at_once(leader.url) == reference
        assert "stops when its leader ends the group" in worker.output()
        leader.proc.send_signal(signal.SIGTERM)
        assert leader.proc.wait(timeout=60) == 0, leader.output()
        assert worker.proc.wait(timeout=60) == 0, worker.output()
        assert "the leader shut the group down" in worker.output()
    finally:
        worker.kill()
        leader.kill()


def test_a_rank_with_the_wrong_secret_is_refused_and_the_leader_names_it():
    leader, worker = two_hosts("right-Zq81x", "wrong-Zq82x", "--group-timeout", "10")
    try:
        assert worker.proc.wait(timeout=120) != 0
        assert "failed authentication: its group secret is not the leader's" in worker.output()
        assert leader.proc.wait(timeout=120) != 0
        out = leader.output()
        assert "rank 1 (refused: rank 1 failed authentication" in out, out
        for log in (out, worker.output()):
            assert "Zq81x" not in log and "Zq82x" not in log, "a secret was logged"
    finally:
        worker.kill()
        leader.kill()


def test_group_flags_without_a_group_are_refused_naming_them():
    out = subprocess.run([BIN, "serve", "--model", MODEL, "--node-rank", "1", "--headless"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "--pipeline-parallel-size" in out.stderr, out.stderr
    out = subprocess.run([BIN, "serve", "--model", MODEL, "--pipeline-parallel-size", "2",
                          "--nnodes", "3"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "--nnodes 3" in out.stderr and "pipeline size 2" in out.stderr, out.stderr


def test_tensor_sizes_that_split_no_kv_heads_or_span_hosts_are_refused_naming_why():
    out = subprocess.run([BIN, "serve", "--model", MODEL, "--tensor-parallel-size", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "--tensor-parallel-size 2" in out.stderr, out.stderr
    assert "2 does not divide the model's 3 KV heads" in out.stderr, out.stderr
    out = subprocess.run([BIN, "serve", "--model", MODEL, "--tensor-parallel-size", "3",
                          "--nnodes", "2"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "tensor-parallel ranks all run on one host" in out.stderr, out.stderr


def test_a_stage_that_stops_fails_health_while_work_waits_and_recovers_when_it_resumes():
    # A stage frozen (SIGSTOP) keeps its connection open, so the leader's step waits on it:
    # the engine lives but makes no progress, which only the stall check can see.
    group = Server("--pipeline-parallel-size", "2", "--stall-timeout", "3")
    [child] = children(group.proc.pid)
    try:
        assert status(group.url) == 200
        os.kill(child, signal.SIGSTOP)
        time.sleep(4)
        assert status(group.url) == 200, "an idle group is not stalled"
        results = []
        request = threading.Thread(
            target=lambda: results.append(complete(group.url, "Tell me a story.", 16)))
        request.start()
        wait_for(lambda: status(group.url) == 500, "/health to fail while the stage is stopped", 60)
        try:
            urllib.request.urlopen(group.url + "/health", timeout=2)
        except urllib.error.HTTPError as e:
            message = e.read().decode()
        assert "no progress" in message and "1 requests pending" in message, message
        os.kill(child, signal.SIGCONT)
        request.join(timeout=120)
        assert results and len(results[0]["logprobs"]["tokens"]) == 16
        wait_for(lambda: status(group.url) == 200, "/health to recover once the stage resumed", 60)
    finally:
        os.kill(child, signal.SIGCONT)
        group.stop(signal.SIGKILL)
