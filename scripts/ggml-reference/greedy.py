"""Greedy outputs of a running llama-server on prompts given as token ids: for each prompt,
the generated ids, the top-2 log-probability margin at each step and how many leading
tokens come before the first margin under 0.02 nats (the ones a correct engine must
reproduce exactly). Usage: greedy.py URL MODEL_LABEL N_PREDICT < prompts.json > cases.json"""
import json
import sys
import urllib.request

NEAR_TIE = 0.02


def complete(url, prompt, n):
    body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1,
                       "n_probs": 2, "cache_prompt": False,
                       "return_tokens": True}).encode()
    req = urllib.request.Request(url + "/completion", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def main():
    url, label, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cases = []
    for prompt in json.load(sys.stdin):
        out = complete(url, prompt, n)
        steps = out["completion_probabilities"]
        ids = [s["id"] for s in steps]
        assert ids == out["tokens"], (ids, out["tokens"])
        margins = [s["top_logprobs"][0]["logprob"] - s["top_logprobs"][1]["logprob"] for s in steps]
        exact = next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(margins))
        cases.append({"model": label, "prompt_ids": prompt, "n": n, "ids": ids,
                      "top2_margin": margins, "exact_until": exact})
    json.dump(cases, sys.stdout)


if __name__ == "__main__":
    main()
