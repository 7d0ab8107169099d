// Prints, as JSON, ggml's own results on deterministic inputs for every weight format
// Ferrite runs: the quantized weight bytes (ggml's reference quantizer), the activation
// bytes (the CPU backend's from_float for the format's vec_dot_type), the dot product of the
// two (the CPU backend's vec_dot) and the dequantized weights (to_float), every float as
// its bit pattern. Built and run by scripts/ggml-reference/regenerate.sh against the
// llama.cpp that make bench-peer builds; the output is committed as
// tests/fixtures/ggml-reference.json, which the kernel tests compare with bit for bit.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"
#include "ggml-cpu.h"

static uint64_t state = 0x9E3779B97F4A7C15ull;

static uint32_t next_u32(void) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (uint32_t)(state >> 32);
}

// Values in [-1, 1) scaled by a per-block magnitude, with edge values sprinkled in: zeros,
// ties of the activation quantizers, and large magnitudes.
static void fill(float * x, int n, int salt) {
    for (int i = 0; i < n; ++i) {
        float u = (float)(next_u32() >> 8) / 16777216.0f * 2.0f - 1.0f;
        float scale = 0.02f + (float)((i / 32 + salt) % 7) * 0.3f;
        x[i] = u * scale;
        switch ((i * 7 + salt) % 61) {
            case 0: x[i] = 0.0f; break;
            case 1: x[i] = -scale; break;
            case 2: x[i] = scale * 0.5f; break;
            case 3: x[i] = -0.0f; break;
        }
    }
}

static void hex(const void * p, size_t n) {
    const uint8_t * b = p;
    putchar('"');
    for (size_t i = 0; i < n; ++i) printf("%02x", b[i]);
    putchar('"');
}

static void bits(const float * x, int n) {
    putchar('[');
    for (int i = 0; i < n; ++i) {
        uint32_t u; memcpy(&u, &x[i], 4);
        printf("%s%u", i ? "," : "", u);
    }
    putchar(']');
}

// One fixture entry: `rows` weight rows of `n` values of `type`, under `key`.
static void emit(enum ggml_type type, int n, int salt, const char * key, int first) {
    const int rows = 2;
    const struct ggml_type_traits * tr = ggml_get_type_traits(type);
    const struct ggml_type_traits_cpu * cpu = ggml_get_type_traits_cpu(type);
    const enum ggml_type dot_type = cpu->vec_dot_type;
    const struct ggml_type_traits_cpu * dot_cpu = ggml_get_type_traits_cpu(dot_type);
    const size_t wbytes = ggml_row_size(type, n), abytes = ggml_row_size(dot_type, n);
    uint8_t * wq = malloc(wbytes), * aq = malloc(abytes);
    float * x = malloc(n * sizeof(float)), * w = malloc(n * sizeof(float));
    float * back = malloc(n * sizeof(float));
    printf("%s\"%s\": {\"activation_type\": \"%s\", \"rows\": [\n", first ? "" : ",\n", key,
           ggml_get_type_traits(dot_type)->type_name);
    for (int r = 0; r < rows; ++r) {
        fill(w, n, 3 * r + salt);
        fill(x, n, 3 * r + salt + 11);
        if (type == GGML_TYPE_F32) {
            memcpy(wq, w, wbytes);
        } else {
            tr->from_float_ref(w, wq, n);
        }
        if (dot_type == GGML_TYPE_F32) {
            memcpy(aq, x, abytes);
        } else {
            dot_cpu->from_float(x, aq, n);
        }
        float s = 0.0f;
        cpu->vec_dot(n, &s, 0, wq, 0, aq, 0, 1);
        if (type == GGML_TYPE_F32) {
            memcpy(back, wq, wbytes);
        } else {
            tr->to_float(wq, back, n);
        }
        printf("%s{\"w\": ", r ? ",\n" : "");
        bits(w, n);
        printf(", \"x\": ");
        bits(x, n);
        printf(", \"weights\": ");
        hex(wq, wbytes);
        printf(", \"activations\": ");
        hex(aq, abytes);
        printf(", \"dot\": ");
        bits(&s, 1);
        printf(", \"dequantized\": ");
        bits(back, n);
        printf("}");
    }
    printf("]}");
    free(wq); free(aq); free(x); free(w); free(back);
}

int main(void) {
    ggml_cpu_init();
    const enum ggml_type types[] = {
        GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1, GGML_TYPE_Q8_0,
        GGML_TYPE_Q2_K, GGML_TYPE_Q3_K, GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K,
        GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_F32,
    };
    printf("{\n");
    // 512 values: two K-quant super-blocks, sixteen small blocks, eight float steps.
    for (size_t t = 0; t < sizeof types / sizeof types[0]; ++t) {
        emit(types[t], 512, (int)t, ggml_get_type_traits(types[t])->type_name, t == 0);
    }
    // Floating-point rows whose length is not a whole number of 64-value steps.
    const enum ggml_type floats[] = { GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_F32 };
    for (size_t t = 0; t < 3; ++t) {
        char key[32];
        snprintf(key, sizeof key, "%s/500", ggml_get_type_traits(floats[t])->type_name);
        emit(floats[t], 500, 20 + (int)t, key, 0);
    }
    printf("\n}\n");
    return 0;
}
