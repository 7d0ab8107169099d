"""Independent reference for Llama-family logits, transcribed from Hugging Face's
LlamaForCausalLM / Qwen2ForCausalLM in plain numpy (float64). A product with F16 or BF16
weights first rounds its activations to f32 and then to the weights' type, as llama.cpp
(and the engine) multiply half-precision weights.

Usage: python llama_reference.py MODEL_DIR TOKEN_ID[,TOKEN_ID...]
Prints a JSON list of per-token logit rows.
"""
import json
import struct
import sys

import numpy as np

DTYPES = {"F32": np.float32, "F16": np.float16}


def to_bf16(x):
    """x rounded to f32, then to bfloat16 (to nearest, ties to even), as float64."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


ROUND = {
    "F32": lambda x: x,
    "F16": lambda x: x.astype(np.float32).astype(np.float16).astype(np.float64),
    "BF16": to_bf16,
}


def load_safetensors(path):
    """The tensors as float64, and each one's stored dtype."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    out = {}
    dtypes = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        raw = body[a:b]
        if info["dtype"] == "BF16":
            bits = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
            arr = bits.view(np.float32)
        else:
            arr = np.frombuffer(raw, dtype=DTYPES[info["dtype"]])
        out[name] = arr.astype(np.float64).reshape(info["shape"])
        dtypes[name] = info["dtype"]
    return out, dtypes


def rms_norm(x, w, eps):
    var = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(var + eps) * w


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def forward(cfg, w, dtypes, ids):
    qwen2 = cfg["architectures"][0] == "Qwen2ForCausalLM"
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hidden = cfg["hidden_size"]
    hd = cfg.get("head_dim") or hidden // heads
    eps = cfg.get("rms_norm_eps", 1e-6)
    theta = cfg.get("rope_theta", 10000.0)
    t = len(ids)
    x = w["model.embed_tokens.weight"][ids]
    inv_freq = 1.0 / (theta ** (np.arange(0, hd, 2) / hd))
    freqs = np.outer(np.arange(t), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)
    mask = np.triu(np.full((t, t), -np.inf), k=1)

    def mm(a, name):
        """a @ W.T, with a rounded as the weights' type has it rounded."""
        return ROUND[dtypes[name]](a) @ w[name].T
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)

        def proj(name):
            y = mm(h, p + f"self_attn.{name}_proj.weight")
            if qwen2 and name != "o":
                y = y + w[p + f"self_attn.{name}_proj.bias"]
            return y

        q = proj("q").reshape(t, heads, hd).transpose(1, 0, 2)
        k = proj("k").reshape(t, kv_heads, hd).transpose(1, 0, 2)
        v = proj("v").reshape(t, kv_heads, hd).transpose(1, 0, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = np.repeat(k, heads // kv_heads, axis=0)
        v = np.repeat(v, heads // kv_heads, axis=0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        s = s / s.sum(axis=-1, keepdims=True)
        a = (s @ v).transpose(1, 0, 2).reshape(t, heads * hd)
        x = x + mm(a, p + "self_attn.o_proj.weight")
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = mm(h, p + "mlp.gate_proj.weight")
        up = mm(h, p + "mlp.up_proj.weight")
        act = gate / (1.0 + np.exp(-gate)) * up
        x = x + mm(act, p + "mlp.down_proj.weight")
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = "model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"
    return mm(x, head)


def main():
    model_dir, ids = sys.argv[1], [int(i) for i in sys.argv[2].split(",")]
    with open(f"{model_dir}/config.json") as f:
        cfg = json.load(f)
    w, dtypes = load_safetensors(f"{model_dir}/model.safetensors")
    json.dump(forward(cfg, w, dtypes, ids).tolist(), sys.stdout)


if __name__ == "__main__":
    main()
