/*
 * A decode or verify forward through every decoder layer in one call: the
 * kernels of packed_linear.c, attention.c and layer_ops.c in the order
 * metrale/engine/runtime/llama.py calls them one by one.
 *
 * Contract: x [rows, hidden] is the residual stream, updated in place. For
 * each layer l, table[l] holds the addresses and formats below (written once
 * by fused_layers.py, which checks the shapes and holds the tensors); the
 * layer computes
 *     h = rms_norm(x, attn_norm); qkv = h @ W_qkv^T; rotate q and k;
 *     write k, v to the cache; a = attention(q); x += a @ W_o^T;
 *     h = rms_norm(x, mlp_norm); x += silu_mul(h @ W_gate_up^T) @ W_down^T
 * for a Llama-style layer (no q/k norms, no biases), with attention over the
 * cache as attention.c's contract states (segments of few rows: not a
 * prefill chunk). The arithmetic is the per-kernel path's, call for call, so
 * the result is bit for bit what llama.py computes without this file.
 *
 * Why: a layer is 11 kernel calls. From Python each costs a ctypes call,
 * argument checks and a tensor allocation; over a whole stack that is as
 * much as the weights' products at one row.
 */
#include <stdint.h>
#include <string.h>

int metrale_packed_linear(int format, const float *x, int64_t M, int64_t K, const uint8_t *data,
                          const float *scales, int64_t N, float *out, int threads);
int metrale_attend(const float *q, int64_t q_stride, const float *keys, const float *values, int64_t heads,
                   int64_t kv_heads, int64_t max_len, int64_t D, int64_t segments, const int64_t *seg,
                   int64_t window, float scale, float *out, int threads);
void metrale_rms_norm(const float *x, int64_t rows, int64_t n, const float *w, float eps, float *out, int threads);
void metrale_rope(float *x, int64_t stride, int64_t rows, int64_t heads, int64_t D, const float *cos_table,
                  const float *sin_table, const int64_t *positions);
void metrale_kv_write(const float *k, int64_t k_stride, const float *v, int64_t v_stride, float *keys,
                      float *values, int64_t kv_heads, int64_t max_len, int64_t D, int64_t segments,
                      const int64_t *seg);
void metrale_silu_mul(const float *gate_up, int64_t rows, int64_t n, float *out, int threads);

/* The fields of one layer's table row. */
enum {
    ATTN_NORM, MLP_NORM,
    QKV_FORMAT, QKV_DATA, QKV_SCALES,
    O_FORMAT, O_DATA, O_SCALES,
    GATE_UP_FORMAT, GATE_UP_DATA, GATE_UP_SCALES,
    DOWN_FORMAT, DOWN_DATA, DOWN_SCALES,
    KEYS, VALUES,
    LAYER_FIELDS,
};

#define PTR(type, field) ((type)(intptr_t)row[field])

static void add_into(float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

/* scratch: rows * (2 hidden + (q + 2 kv) + q + 3 intermediate) floats. Returns 0, or the first failing kernel's code (-1 a bad format or
 * head count, -2 out of memory). */
int metrale_decoder_layers(
    float *x, int64_t rows, int64_t layers, const int64_t *table, int64_t hidden, int64_t heads,
    int64_t kv_heads, int64_t D, int64_t intermediate, float eps, const float *cos_table,
    const float *sin_table, const int64_t *positions, int64_t max_len, int64_t segments, const int64_t *seg,
    int64_t window, float scale, float *scratch, int threads) {
    const int64_t q_size = heads * D, kv_size = kv_heads * D, qkv_width = q_size + 2 * kv_size;
    float *h = scratch;                        /* [rows, hidden] */
    float *qkv = h + rows * hidden;            /* [rows, q + 2 kv] */
    float *att = qkv + rows * qkv_width;       /* [rows, q] */
    float *gate_up = att + rows * q_size;      /* [rows, 2 intermediate] */
    float *act = gate_up + rows * 2 * intermediate; /* [rows, intermediate] */
    float *delta = act + rows * intermediate;  /* [rows, hidden]: a product to add to x */
    for (int64_t l = 0; l < layers; l++) {
        const int64_t *row = table + l * LAYER_FIELDS;
        float *keys = PTR(float *, KEYS), *values = PTR(float *, VALUES);
        int code;
        metrale_rms_norm(x, rows, hidden, PTR(const float *, ATTN_NORM), eps, h, threads);
        code = metrale_packed_linear((int)row[QKV_FORMAT], h, rows, hidden, PTR(const uint8_t *, QKV_DATA),
                                     PTR(const float *, QKV_SCALES), qkv_width, qkv, threads);
        if (code != 0) return code;
        /* q and k sit side by side in each qkv row: rotated in one call */
        metrale_rope(qkv, qkv_width, rows, heads + kv_heads, D, cos_table, sin_table, positions);
        metrale_kv_write(qkv + q_size, qkv_width, qkv + q_size + kv_size, qkv_width, keys, values, kv_heads,
                         max_len, D, segments, seg);
        code = metrale_attend(qkv, qkv_width, keys, values, heads, kv_heads, max_len, D, segments, seg, window,
                              scale, att, threads);
        if (code != 0) return code;
        code = metrale_packed_linear((int)row[O_FORMAT], att, rows, q_size, PTR(const uint8_t *, O_DATA),
                                     PTR(const float *, O_SCALES), hidden, delta, threads);
        if (code != 0) return code;
        add_into(x, delta, rows * hidden);
        metrale_rms_norm(x, rows, hidden, PTR(const float *, MLP_NORM), eps, h, threads);
        code = metrale_packed_linear((int)row[GATE_UP_FORMAT], h, rows, hidden, PTR(const uint8_t *, GATE_UP_DATA),
                                     PTR(const float *, GATE_UP_SCALES), 2 * intermediate, gate_up, threads);
        if (code != 0) return code;
        metrale_silu_mul(gate_up, rows, intermediate, act, threads);
        code = metrale_packed_linear((int)row[DOWN_FORMAT], act, rows, intermediate, PTR(const uint8_t *, DOWN_DATA),
                                     PTR(const float *, DOWN_SCALES), hidden, delta, threads);
        if (code != 0) return code;
        add_into(x, delta, rows * hidden);
    }
    return 0;
}
