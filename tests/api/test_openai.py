"""The official `openai` SDK against a real Ferrite server: every endpoint, streaming,
sampling options and every error case, checked for what a client sees."""
import json
import threading
import time
import urllib.request

import httpx
import openai
import pytest

from conftest import MAX_MODEL_LEN, NAME, Server

GREEDY = dict(temperature=0, max_tokens=12)


def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]


def test_completion_is_llama_cpp_greedy_text(client):
    r = client.completions.create(model=NAME, prompt="The capital of France is", **GREEDY)
    assert r.object == "text_completion"
    # llama.cpp's greedy text on the same GGUF (tests/fixtures).
    assert r.choices[0].text.startswith(" Paris.\n\nThe United States has a population")
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 12, 17)


def test_prompt_as_token_ids_and_lists(client):
    ids = [504, 3575, 282, 4649, 314]
    one = client.completions.create(model=NAME, prompt=ids, **GREEDY)
    many = client.completions.create(model=NAME, prompt=["The capital of France is", "def fibonacci(n):"], **GREEDY)
    assert one.choices[0].text == many.choices[0].text
    assert len(many.choices) == 2 and many.choices[1].index == 1
    assert many.usage.prompt_tokens == 5 + 6


def test_chat_completion(client):
    r = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "What is the boiling point of water?"}], **GREEDY)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content.startswith("The boiling point of water")
    assert r.usage.completion_tokens == 12


def test_chat_text_parts_and_system_message(client):
    r = client.chat.completions.create(model=NAME, messages=[
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": [{"type": "text", "text": "Give me a synonym for happy."}]},
    ], **GREEDY)
    assert r.choices[0].message.content


def test_streaming_chat_matches_non_streaming(client):
    messages = [{"role": "user", "content": "Hi!"}]
    whole = client.chat.completions.create(model=NAME, messages=messages, **GREEDY)
    chunks = list(client.chat.completions.create(
        model=NAME, messages=messages, stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_streaming_completion_ends_with_done(server):
    body = json.dumps({"model": NAME, "prompt": "Once upon a time", "max_tokens": 5, "stream": True}).encode()
    req = urllib.request.Request(server.url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [l for l in r.read().decode().split("\n") if l.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_n_choices(client):
    r = client.completions.create(model=NAME, prompt="My favourite colour is", n=2, temperature=1.0, seed=3,
                                  max_tokens=8, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 16


def test_stop_strings_end_generation_and_are_not_returned(client):
    r = client.completions.create(model=NAME, prompt="1, 2, 3, 4, 5,", stop=[" 8"], temperature=0, max_tokens=30)
    assert r.choices[0].finish_reason == "stop"
    assert " 8" not in r.choices[0].text and r.choices[0].text.startswith(" 6, 7,")


def test_same_seed_same_text(client):
    args = dict(model=NAME, prompt="Once upon a time", temperature=1.0, top_p=0.95, max_tokens=16)
    a = client.completions.create(seed=7, **args).choices[0].text
    b = client.completions.create(seed=7, **args).choices[0].text
    c = client.completions.create(seed=8, **args).choices[0].text
    assert a == b
    assert a != c


def test_logit_bias_forces_and_bans_tokens(client):
    paris = client.completions.create(model=NAME, prompt="The capital of France is", **GREEDY)
    assert paris.choices[0].text.startswith(" Paris")
    # 3575 is " capital" in this vocabulary: +100 makes it every token; -100 on " Paris" (7042)
    # makes the greedy choice something else.
    forced = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=3,
                                       temperature=0, logit_bias={"3575": 100})
    assert forced.choices[0].text == " capital capital capital"
    banned = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=3,
                                       temperature=0, logit_bias={"7042": -100})
    assert not banned.choices[0].text.startswith(" Paris")


def test_completion_logprobs(client):
    r = client.completions.create(model=NAME, prompt="The capital of France is", logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert lp.tokens[0] == " Paris" and all(len(t) == 2 for t in lp.top_logprobs)
    assert all(l <= 0 for l in lp.token_logprobs)


def test_echo_with_logprobs_scores_the_prompt_as_evaluation_harnesses_ask(client):
    # lm-evaluation-harness's loglikelihood request: the prompt's tokens come back scored.
    prompt = "The capital of France is Paris"
    r = client.completions.create(model=NAME, prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0)
    lp, usage = r.choices[0].logprobs, r.usage
    assert len(lp.tokens) == len(lp.token_logprobs) == usage.prompt_tokens + 1
    assert "".join(lp.tokens) == r.choices[0].text and r.choices[0].text.startswith(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(l <= 0 for l in lp.token_logprobs[1:]) and all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # " Paris" after "The capital of France is" is the model's own greedy choice there.
    paris = lp.tokens.index(" Paris")
    assert lp.top_logprobs[paris] == {" Paris": lp.token_logprobs[paris]}
    # Streamed, the echoed prompt's chunk carries the same scores.
    chunks = list(client.completions.create(model=NAME, prompt=prompt, echo=True, logprobs=1, max_tokens=1,
                                            temperature=0, stream=True))
    first = chunks[0].choices[0]
    assert first.text == prompt and first.logprobs.token_logprobs == lp.token_logprobs[:-1]


def test_every_choice_of_a_scored_prompt_carries_scores_computed_once(client, server):
    # n = 3: the first choice scores the prompt, the others share its scores and its blocks.
    prompt = " ".join(["The capital of France is Paris."] * 6)
    hits_name = f'vllm:prefix_cache_hits_total{{model_name="{NAME}"}}'
    before = server.metrics()[hits_name]
    ask = dict(model=NAME, prompt=prompt, echo=True, logprobs=1, max_tokens=2, n=3, temperature=0)
    r = client.completions.create(**ask)
    scored = r.usage.prompt_tokens
    first = r.choices[0].logprobs
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        assert c.text.startswith(prompt) and c.text == r.choices[0].text
        assert c.logprobs.tokens == first.tokens and c.logprobs.text_offset == first.text_offset
        assert c.logprobs.token_logprobs[:scored] == first.token_logprobs[:scored]
    assert first.token_logprobs[0] is None and all(l <= 0 for l in first.token_logprobs[1:])
    # The later two choices found the prompt's full 16-token blocks in the prefix cache.
    full = (scored - 1) // 16 * 16
    assert full >= 32 and server.metrics()[hits_name] - before >= 2 * full
    # Streamed, every choice opens with the scored echo, before any of its tokens.
    seen = {}
    for chunk in client.completions.create(**ask, stream=True):
        for c in chunk.choices:
            seen.setdefault(c.index, c)
    assert sorted(seen) == [0, 1, 2]
    for c in seen.values():
        assert c.text == prompt and c.logprobs.token_logprobs == first.token_logprobs[:scored]


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi!"}],
                                       logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    assert content[0].top_logprobs[0].token == content[0].token


def test_tokenize_and_detokenize(server):
    def post(path, payload):
        req = urllib.request.Request(server.url + path, json.dumps(payload).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req) as r:
            return json.load(r)
    t = post("/tokenize", {"model": NAME, "prompt": "The capital of France is"})
    assert t["tokens"] == [504, 3575, 282, 4649, 314] and t["max_model_len"] == MAX_MODEL_LEN
    assert post("/detokenize", {"model": NAME, "tokens": t["tokens"]})["prompt"] == "The capital of France is"


def test_version_and_health(server):
    with urllib.request.urlopen(server.url + "/version") as r:
        assert json.load(r)["version"]
    with urllib.request.urlopen(server.url + "/health") as r:
        assert r.status == 200


@pytest.mark.parametrize("kwargs,param,words", [
    (dict(top_p=1.5), "top_p", "(0, 1]"),
    (dict(temperature=-1), "temperature", "[0, 2]"),
    (dict(presence_penalty=3), "presence_penalty", "[-2, 2]"),
    (dict(max_tokens=0), "max_tokens", "at least 1"),
    (dict(n=0), "n", "[1, 16]"),
    (dict(logprobs=50), "logprobs", "[0, 20]"),
    (dict(extra_body={"top_k": -5}), "top_k", "-1"),
    (dict(extra_body={"bogus_option": 1}), "bogus_option", "unrecognized"),
])
def test_out_of_range_parameters_are_400_naming_the_field(client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="hi", **kwargs)
    body = e.value.body
    assert e.value.status_code == 400 and body["param"] == param
    assert param in body["message"] and words in body["message"]


def test_prompt_longer_than_max_model_len_says_both_numbers(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="hello " * 10, max_tokens=MAX_MODEL_LEN)
    assert str(MAX_MODEL_LEN) in e.value.body["message"] and "max_tokens" in e.value.body["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="hi")
    assert "gpt-4" in e.value.body["message"] and NAME in e.value.body["message"]


def test_malformed_json_is_400(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_unsupported_message_role_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "narrator", "content": "x"}], max_tokens=4)
    assert e.value.body["param"] == "messages"
    assert "narrator" in e.value.body["message"] and "assistant or tool" in e.value.body["message"]


def test_64_concurrent_streams_complete_and_the_metrics_add_up(server):
    before = server.metrics()
    client = server.client()
    received, errors = [], []

    def one(i):
        try:
            stream = client.completions.create(
                model=NAME, prompt=f"Story number {i}:", max_tokens=8, temperature=0.7, seed=i,
                stream=True, stream_options={"include_usage": True})
            usage = [c.usage.completion_tokens for c in stream if c.usage]
            received.append(usage[0])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and len(received) == 64
    after = wait_idle(server)
    key = f'vllm:generation_tokens_total{{model_name="{NAME}"}}'
    assert after[key] - before[key] == sum(received) == 64 * 8


def wait_idle(server, timeout=30):
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        idle = (m[f'vllm:num_requests_running{{model_name="{NAME}"}}'] == 0
                and m[f'vllm:num_requests_waiting{{model_name="{NAME}"}}'] == 0
                and m[f'vllm:kv_cache_usage_perc{{model_name="{NAME}"}}'] == 0)
        if idle or time.time() > deadline:
            assert idle, m
            return m
        time.sleep(0.1)


def test_clients_that_disconnect_mid_stream_free_everything(server):
    body = json.dumps({"model": NAME, "prompt": "Tell me a long story.", "max_tokens": 400,
                       "ignore_eos": True, "stream": True})
    for _ in range(16):
        with httpx.stream("POST", server.url + "/v1/completions", content=body,
                          headers={"Content-Type": "application/json"}, timeout=60) as r:
            for i, _line in enumerate(r.iter_lines()):
                if i >= 4:
                    break
    m = wait_idle(server)
    assert m[f'vllm:generation_tokens_total{{model_name="{NAME}"}}'] < 16 * 400


def test_metrics_use_vllm_names(server):
    m = server.metrics()
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_count",
                 "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total"]:
        assert f'vllm:{name}{{model_name="{NAME}"}}' in m, name
    assert m[f'vllm:request_success_total{{finished_reason="length",model_name="{NAME}"}}'] > 0


def test_per_request_series_count_what_each_request_was(client, server):
    """vLLM's per-request histograms and the step histogram move by what one call did."""
    wait_idle(server)
    label = f'{{model_name="{NAME}"}}'
    before = server.metrics()
    prompt = " ".join(["The river runs to the sea."] * 6)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=5, n=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    p = r.usage.prompt_tokens
    assert r.usage.completion_tokens == 10
    after = wait_idle(server)

    def moved(series):
        return after[f"vllm:{series}{label}"] - before.get(f"vllm:{series}{label}", 0)

    # One prompt with n = 2: one observation of n and max_tokens; two finished requests.
    assert (moved("request_params_n_count"), moved("request_params_n_sum")) == (1, 2)
    assert (moved("request_params_max_tokens_count"), moved("request_params_max_tokens_sum")) == (1, 5)
    assert (moved("request_prompt_tokens_count"), moved("request_prompt_tokens_sum")) == (2, 2 * p)
    assert (moved("request_generation_tokens_count"), moved("request_generation_tokens_sum")) == (2, 10)
    for phase in ["prefill", "decode", "inference"]:
        assert moved(f"request_{phase}_time_seconds_count") == 2, phase
    assert moved("request_time_per_output_token_seconds_count") == 2
    assert moved("request_time_per_output_token_seconds_sum") > 0
    assert (moved("request_num_preemptions_count"), moved("request_num_preemptions_sum")) == (2, 0)
    # The second choice found the prompt's full blocks in the cache; what was computed is
    # the rest, request by request.
    cached = moved("prompt_tokens_cached_total")
    assert cached >= (p - 1) // 16 * 16 >= 32
    assert moved("request_prefill_kv_computed_tokens_sum") == 2 * p - cached
    # Every step's tokens are in the step histogram: at least the computed prompt tokens
    # and the ten generated.
    assert moved("iteration_tokens_total_count") >= 5
    assert moved("iteration_tokens_total_sum") >= 2 * p - cached + 10
    assert after[f'vllm:iteration_tokens_total_bucket{{model_name="{NAME}",le="+Inf"}}'] == \
        after[f"vllm:iteration_tokens_total_count{label}"]
    # The prefix cache counts every token of each sequence it was asked for, as vLLM does.
    assert moved("prefix_cache_queries_total") == 2 * p
    assert moved("prefix_cache_hits_total") == cached


def test_the_cache_configuration_says_the_blocks_are_in_cpu_memory(server):
    info = [k for k in server.metrics() if k.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and 'device="cpu"' in info[0], info


def test_sigterm_finishes_in_flight_requests_and_refuses_new_ones():
    s = Server("--shutdown-timeout", "60")
    client = s.client()
    result = {}

    def long_request():
        r = client.completions.create(model=NAME, prompt="Count: 1, 2, 3,", max_tokens=60,
                                      temperature=0, extra_body={"ignore_eos": True})
        result["tokens"] = r.usage.completion_tokens

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(1.0)
    s.proc.send_signal(__import__("signal").SIGTERM)
    time.sleep(0.3)
    with pytest.raises((openai.APIConnectionError, openai.APIStatusError)):
        client.completions.create(model=NAME, prompt="too late", max_tokens=2)
    t.join(timeout=120)
    assert result.get("tokens") == 60
    assert s.stop() == 0


def test_a_full_waiting_queue_answers_503_with_retry_after():
    s = Server("--max-num-seqs", "1", "--max-waiting-requests", "1")
    client = s.client()
    body = dict(model=NAME, prompt="Count: 1, 2, 3,", max_tokens=150, temperature=0, extra_body={"ignore_eos": True})
    try:
        busy = [threading.Thread(target=lambda: client.completions.create(**body)) for _ in range(2)]
        busy[0].start()
        time.sleep(0.5)
        busy[1].start()
        deadline = time.time() + 10
        while server_waiting(s) < 1:
            assert time.time() < deadline, "the second request never waited"
            time.sleep(0.05)
        r = httpx.post(s.url + "/v1/completions", json={"model": NAME, "prompt": "one more", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "--max-waiting-requests 1" in r.json()["error"]["message"]
        for t in busy:
            t.join(timeout=120)
    finally:
        s.stop()


def server_waiting(server):
    return server.metrics()[f'vllm:num_requests_waiting{{model_name="{NAME}"}}']


def test_a_burst_far_past_the_waiting_bound_never_waits_more_than_the_bound():
    s = Server("--max-num-seqs", "2", "--max-waiting-requests", "4")
    body = {"model": NAME, "prompt": "Count: 1, 2, 3,", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    peak, done, results = [0], threading.Event(), []

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], server_waiting(s))
            time.sleep(0.005)

    def one():
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=300)
        results.append(r)

    try:
        sampler = threading.Thread(target=sample)
        sampler.start()
        burst = [threading.Thread(target=one) for _ in range(60)]
        for t in burst:
            t.start()
        for t in burst:
            t.join(timeout=300)
        done.set()
        sampler.join()
        assert len(results) == 60
        accepted = [r for r in results if r.status_code == 200]
        refused = [r for r in results if r.status_code == 503]
        assert len(accepted) + len(refused) == 60, [r.status_code for r in results]
        assert len(accepted) >= 4 and refused, (len(accepted), len(refused))
        assert all(r.json()["usage"]["completion_tokens"] == 12 for r in accepted)
        for r in refused:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "service_unavailable_error"
            assert "--max-waiting-requests 4" in r.json()["error"]["message"]
        assert 0 < peak[0] <= 4, peak[0]
    finally:
        done.set()
        s.stop()


def test_a_body_over_the_size_limit_is_refused_in_openai_error_json(server):
    big = json.dumps({"model": NAME, "prompt": "x" * (3 << 20), "max_tokens": 1})
    r = httpx.post(server.url + "/v1/completions", content=big,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 413
    assert "larger than" in error["message"]


def test_a_client_that_leaves_mid_stream_is_counted_as_an_abort(server):
    key = f'vllm:request_success_total{{finished_reason="abort",model_name="{NAME}"}}'
    before = server.metrics()[key]
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "model": NAME, "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True,
            "stream": True}) as r:
        next(r.iter_lines())
    running = f'vllm:num_requests_running{{model_name="{NAME}"}}'
    deadline = time.time() + 60
    while time.time() < deadline:
        m = server.metrics()
        if m[key] == before + 1 and m[running] == 0:
            break
        time.sleep(0.1)
    m = server.metrics()
    assert (m[key], m[running]) == (before + 1, 0)
