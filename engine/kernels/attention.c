/*
 * Attention of a few query rows per sequence over its own KV-cache slot,
 * in float32: the decode and verify steps of the batch engine.
 *
 * Contract: segment s is (slot, start, rows, row0): its query rows are the
 * packed rows row0 .. row0 + rows - 1, at positions start .. start + rows - 1,
 * and its keys and values are already written to the cache at positions
 * 0 .. start + rows - 1. For query row r at position p and query head h
 * (reading kv head h / G, G = heads / kv_heads),
 *     out[row0 + r][h] = sum_j softmax_j(scale * q . K[j]) * V[j]
 * over cache positions j in [max(0, p - window + 1), p] (window 0: all of
 * them). Cache layout: [slots, kv_heads, max_len, D], as kv_cache.py keeps it.
 *
 * Why: a batched step used to pad every sequence to the longest one and
 * mask, so each read the longest sequence's cache length, in small matrix
 * products that never reach the memory bus's speed. Here each (sequence,
 * kv head) is one task that reads its keys and values once, for all the
 * query heads and rows that share them.
 *
 * Batch invariance: a query's result depends only on its own segment, and
 * every sum runs in a fixed order, so a sequence's attention does not change
 * with the sequences batched beside it (as long as the forward comes here:
 * llama.py sends forwards whose segments are all short).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define METRALE_AVX2 1
#endif

static inline float dot(const float *a, const float *b, int64_t D) {
#ifdef METRALE_AVX2
    if (D % 8 == 0) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
#endif
    float s = 0.0f;
    for (int64_t d = 0; d < D; d++) s += a[d] * b[d];
    return s;
}

/* y += a * x over D values. */
static inline void axpy(float a, const float *x, float *y, int64_t D) {
#ifdef METRALE_AVX2
    if (D % 8 == 0) {
        const __m256 av = _mm256_set1_ps(a);
        for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(y + d, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + d), _mm256_loadu_ps(y + d)));
        return;
    }
#endif
    for (int64_t d = 0; d < D; d++) y[d] += a * x[d];
}

/* q: row t, head h at q + t * q_stride + h * D. seg: [segments][4] as in the
 * contract. out: [rows in all, heads * D], contiguous. Returns 0, -1 for
 * heads not a multiple of kv_heads, -2 when out of memory. */
int metrale_attend(
    const float *q, int64_t q_stride, const float *keys, const float *values, int64_t heads,
    int64_t kv_heads, int64_t max_len, int64_t D, int64_t segments, const int64_t *seg,
    int64_t window, float scale, float *out, int threads) {
    if (kv_heads <= 0 || heads % kv_heads != 0) return -1;
    const int64_t G = heads / kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scores = NULL;
        int64_t capacity = 0;
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t s = 0; s < segments; s++) {
            for (int64_t kvh = 0; kvh < kv_heads; kvh++) {
                const int64_t slot = seg[4 * s], start = seg[4 * s + 1];
                const int64_t rows = seg[4 * s + 2], row0 = seg[4 * s + 3];
                const int64_t end = start + rows; /* positions read: < end */
                int64_t first = 0;                /* the lowest any row reads */
                if (window > 0 && start - window + 1 > 0) first = start - window + 1;
                const int64_t span = end - first;
                if (G * rows * span > capacity) {
                    free(scores);
                    capacity = G * rows * span;
                    scores = (float *)malloc(sizeof(float) * capacity);
                }
                if (scores == NULL) {
                    failed = 1;
                    capacity = 0;
                    continue;
                }
                const int64_t base = (slot * kv_heads + kvh) * max_len;
                const float *K = keys + base * D, *V = values + base * D;
                /* Scores, reading each key once for every query that sees it. */
                for (int64_t j = first; j < end; j++) {
                    const float *kj = K + j * D;
                    for (int64_t r = 0; r < rows; r++) {
                        const int64_t p = start + r;
                        if (j > p || (window > 0 && p - j >= window)) continue;
                        const float *qr = q + (row0 + r) * q_stride + kvh * G * D;
                        float *sr = scores + r * G * span + (j - first);
                        for (int64_t g = 0; g < G; g++) sr[g * span] = scale * dot(qr + g * D, kj, D);
                    }
                }
                /* Softmax and the weighted sum of values, one query at a time. */
                for (int64_t r = 0; r < rows; r++) {
                    const int64_t p = start + r;
                    const int64_t lo = window > 0 && p - window + 1 > first ? p - window + 1 : first;
                    for (int64_t g = 0; g < G; g++) {
                        float *sc = scores + (r * G + g) * span; /* sc[j - first]: position j */
                        float top = -INFINITY, total = 0.0f;
                        for (int64_t j = lo; j <= p; j++) top = sc[j - first] > top ? sc[j - first] : top;
                        for (int64_t j = lo; j <= p; j++) {
                            sc[j - first] = expf(sc[j - first] - top);
                            total += sc[j - first];
                        }
                        float *o = out + (row0 + r) * heads * D + (kvh * G + g) * D;
                        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
                        for (int64_t j = lo; j <= p; j++) axpy(sc[j - first], V + j * D, o, D);
                        const float inv = 1.0f / total;
                        for (int64_t d = 0; d < D; d++) o[d] *= inv;
                    }
                }
            }
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
