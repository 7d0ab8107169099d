"""Writes a tiny Llama-shaped GGUF with random f32 weights (seeded), for llama.cpp's
quantizer to turn into K-quant and other test models.

Shape: hidden 256 and FFN 768 (multiples of 256, so every K-quant applies to every matrix),
4 query heads on 2 KV heads of 64, 2 layers, a 134-token byte-level BPE vocabulary, 512
positions. The vocabulary holds the 128 ASCII bytes (so every token's text is whole UTF-8,
which llama-server needs to report each token's probabilities), five merges and an end token.
Other shapes for benchmarks (its text is noise, its speed is real): --hidden, --ffn, --heads,
--kv-heads, --layers, --ctx (positions), and --vocab (filler tokens `w<i>` after the byte tokens, which no merge
produces); --f16 stores the matrices in F16, --bf16 in BF16 (rounded to nearest even); --tied
writes no output.weight (the embedding is the output projection, as in SmolLM2).
Usage: tiny_model.py OUT.gguf [shape flags] (run with llama.cpp's gguf-py on PYTHONPATH)."""
import argparse

import numpy as np

import gguf



def byte_tokens():
    """GPT-2's byte-to-unicode table: the single-byte tokens of the ASCII bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, (chr(c) for c in cs)))
    return [table[b] for b in range(128)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=134)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--f16", action="store_true")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--tied", action="store_true")
    a = p.parse_args()
    HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = a.hidden, a.ffn, a.heads, a.kv_heads, a.layers
    out = a.out
    rng = np.random.default_rng(20261201)
    tokens = byte_tokens()
    merges = ["Ġ t", "h e", "Ġt he", "i n", "a n"]
    for m in merges:
        tokens.append(m.replace(" ", ""))
    tokens.extend(f"w{i}" for i in range(max(0, a.vocab - len(tokens) - 1)))
    tokens.append("<|endoftext|>")
    vocab = len(tokens)
    types = [1] * (vocab - 1) + [3]

    w = gguf.GGUFWriter(out, "llama")
    w.add_name("ferrite-tiny-random")
    w.add_context_length(a.ctx)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(
        gguf.LlamaFileType.MOSTLY_BF16 if a.bf16
        else gguf.LlamaFileType.MOSTLY_F16 if a.f16
        else gguf.LlamaFileType.ALL_F32
    )
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab - 1)
    w.add_eos_token_id(vocab - 1)
    w.add_add_bos_token(False)

    def mat(rows, cols, scale):
        half = a.f16 or a.bf16
        m = rng.standard_normal((rows, cols), dtype=np.float32) if half else rng.standard_normal((rows, cols))
        if a.bf16:
            bits = (m * scale).astype(np.float32).view(np.uint32)
            return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return (m * scale).astype(np.float16 if a.f16 else np.float32)

    def add_mat(name, rows, cols, scale):
        m = mat(rows, cols, scale)
        w.add_tensor(name, m, raw_dtype=gguf.GGMLQuantizationType.BF16 if a.bf16 else None)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    hd = HIDDEN // HEADS
    add_mat("token_embd.weight", vocab, HIDDEN, 1.0)
    for l in range(LAYERS):
        w.add_tensor(f"blk.{l}.attn_norm.weight", norm(HIDDEN))
        add_mat(f"blk.{l}.attn_q.weight", HEADS * hd, HIDDEN, 0.08)
        add_mat(f"blk.{l}.attn_k.weight", KV_HEADS * hd, HIDDEN, 0.08)
        add_mat(f"blk.{l}.attn_v.weight", KV_HEADS * hd, HIDDEN, 0.08)
        add_mat(f"blk.{l}.attn_output.weight", HIDDEN, HEADS * hd, 0.08)
        w.add_tensor(f"blk.{l}.ffn_norm.weight", norm(HIDDEN))
        add_mat(f"blk.{l}.ffn_gate.weight", FFN, HIDDEN, 0.08)
        add_mat(f"blk.{l}.ffn_up.weight", FFN, HIDDEN, 0.08)
        add_mat(f"blk.{l}.ffn_down.weight", HIDDEN, FFN, 0.05)
    w.add_tensor("output_norm.weight", norm(HIDDEN))
    if not a.tied:
        add_mat("output.weight", vocab, HIDDEN, 0.25)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
