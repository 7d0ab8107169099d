"""Reads llama-quantize --dry-run logs and writes the type it chose for every tensor, per model
and mix, as JSON: {"models": [{"name", "layers", "hidden", "ffn", "heads", "kv_heads", "tied",
"types": {mix: {tensor: type}}}]}, for tests/fixtures/llama-quantize-mixes.json.
Usage: quant_mixes.py MODELS.json LOG_DIR > OUT.json, where MODELS.json lists the models (the
fields above but "types") and LOG_DIR holds <name>-<mix>.log for each."""
import json
import re
import sys

LINE = re.compile(r"^\[\s*\d+/\s*\d+\]\s+(\S+)\s+- .*\(([A-Za-z0-9_]+)\)\s*$")


def types(path):
    out = {}
    with open(path) as f:
        for line in f:
            m = LINE.match(line.strip())
            if m:
                out[m.group(1)] = m.group(2).lower()
    return out


def main():
    models = json.load(open(sys.argv[1]))
    mixes = ["q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m"]
    for m in models:
        m["types"] = {mix: types(f"{sys.argv[2]}/{m['name']}-{mix}.log") for mix in mixes}
    json.dump({"models": models}, sys.stdout, indent=1, sort_keys=True)
    print()


if __name__ == "__main__":
    main()
