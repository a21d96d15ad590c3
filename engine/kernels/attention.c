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
 * Why: padding every sequence to the longest one and masking would make each
 * read the longest sequence's cache length, in small matrix products that
 * never reach the memory bus's speed. Here each query row reads only its own
 * sequence's positions: its scores four keys at a time, the softmax with a
 * vector exp (exp8, within 2 ulp of expf), and the weighted sum of values in
 * registers. A task is a (sequence, kv head) with its query heads, or a
 * (sequence, query head) when there are too few of those for the threads.
 *
 * Batch invariance: a query's result depends only on its own segment, and
 * every sum runs in a fixed order set by the query's own positions, so a
 * row's attention does not change with the rows and sequences batched beside
 * it (as long as the forward comes here: llama.py sends forwards whose
 * segments are all short).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define METRALE_AVX2 1
#endif
#include "vector_math.h"

#ifdef METRALE_AVX2
/* out[i] = q . k_i for four keys (D a multiple of 8): four independent
 * chains. Each dot is 8 lane sums over d in order, then the same pairwise
 * tree, so a (query, key) pair gives the same float in any group of four. */
static inline __m128 dot4(const float *q, const float *k0, const float *k1, const float *k2, const float *k3, int64_t D) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
    }
    /* hadd pairs lanes within each accumulator: [a0 01 23, a1 01 23, a0 45 67, ...] */
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Lanes [0, n) of a vector mask, n <= 8. */
static inline __m256i first_lanes(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* One query over positions [lo, p]: sc holds its scaled scores at sc[j - lo]
 * and gets overwritten; out [D] = softmax-weighted sum of V's rows. */
static void softmax_values(float *sc, int64_t n, const float *V, int64_t D, float *out) {
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(sc + j));
    float top = -INFINITY;
    for (; j < n; j++) top = sc[j] > top ? sc[j] : top;
    for (int i = 0; i < 8; i++) top = top8[i] > top ? top8[i] : top; /* max: any order is exact */
    const __m256 topv = _mm256_set1_ps(top);
    __m256 total8 = _mm256_setzero_ps();
    for (j = 0; j < n; j += 8) {
        const __m256i mask = first_lanes(n - j);
        const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(sc + j, mask), topv)), _mm256_castsi256_ps(mask));
        _mm256_maskstore_ps(sc + j, mask, e);
        total8 = _mm256_add_ps(total8, e);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / hsum8(total8));
    for (int64_t d0 = 0; d0 < D; d0 += 64) { /* 8 accumulators: 64 values of the output */
        const int64_t width = D - d0 < 64 ? D - d0 : 64;
        __m256 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        for (j = 0; j < n; j++) {
            const __m256 w = _mm256_broadcast_ss(sc + j);
            const float *v = V + j * D + d0;
            for (int i = 0; i < 8; i++)
                if (8 * i < width) acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * i), acc[i]);
        }
        for (int i = 0; i < 8; i++)
            if (8 * i < width) _mm256_storeu_ps(out + d0 + 8 * i, _mm256_mul_ps(acc[i], inv));
    }
}
#endif

/* The portable path, for any D: the same maths with the C library's expf. */
static void softmax_values_scalar(float *sc, int64_t n, const float *V, int64_t D, float *out) {
    float top = -INFINITY, total = 0.0f;
    for (int64_t j = 0; j < n; j++) top = sc[j] > top ? sc[j] : top;
    for (int64_t j = 0; j < n; j++) {
        sc[j] = expf(sc[j] - top);
        total += sc[j];
    }
    for (int64_t d = 0; d < D; d++) out[d] = 0.0f;
    for (int64_t j = 0; j < n; j++)
        for (int64_t d = 0; d < D; d++) out[d] += sc[j] * V[j * D + d];
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < D; d++) out[d] *= inv;
}

static float dot_scalar(const float *a, const float *b, int64_t D) {
    float s = 0.0f;
    for (int64_t d = 0; d < D; d++) s += a[d] * b[d];
    return s;
}

/* One query row at position p over K and V (its kv head's cache rows):
 * out [D]. scores: room for p + 9 floats. */
static void attend_row(
    const float *qr, const float *K, const float *V, int64_t D, int64_t p, int64_t window, float scale, int vector,
    float *scores, float *out) {
    const int64_t lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0; /* reads lo .. p */
    const int64_t n = p - lo + 1;
    if (!vector) {
        for (int64_t j = 0; j < n; j++) scores[j] = scale * dot_scalar(qr, K + (lo + j) * D, D);
        softmax_values_scalar(scores, n, V + lo * D, D, out);
        return;
    }
#ifdef METRALE_AVX2
    const __m128 scale4 = _mm_set1_ps(scale);
    for (int64_t j = 0; j < n; j += 4) {
        /* past the row's last position, repeat it: same sums, discarded */
        const float *k0 = K + (lo + j) * D;
        const float *k1 = j + 1 < n ? k0 + D : k0, *k2 = j + 2 < n ? k0 + 2 * D : k0;
        const float *k3 = j + 3 < n ? k0 + 3 * D : k0;
        _mm_storeu_ps(scores + j, _mm_mul_ps(scale4, dot4(qr, k0, k1, k2, k3, D)));
    }
    softmax_values(scores, n, V + lo * D, D, out);
#endif
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
#ifdef METRALE_AVX2
    const int vector = D % 8 == 0;
#else
    const int vector = 0;
#endif
    /* A task is a sequence's kv head with all the query heads that share it
     * (its keys and values then come from memory once, and stay in cache for
     * the others), unless that leaves too few tasks to keep the threads
     * busy: one sequence of 3 kv heads on 2 threads. Then each query head is
     * a task. The split never changes a result. */
    const int64_t per_task = segments * kv_heads >= 4 * threads ? G : 1;
    const int64_t tasks_per_segment = heads / per_task;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scores = NULL;
        int64_t capacity = 0;
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t s = 0; s < segments; s++) {
            for (int64_t task = 0; task < tasks_per_segment; task++) {
                const int64_t slot = seg[4 * s], start = seg[4 * s + 1];
                const int64_t rows = seg[4 * s + 2], row0 = seg[4 * s + 3];
                const int64_t span = start + rows; /* the most positions a row reads */
                if (span > capacity) {
                    free(scores);
                    capacity = span;
                    scores = (float *)malloc(sizeof(float) * (capacity + 8));
                }
                if (scores == NULL) {
                    failed = 1;
                    capacity = 0;
                    continue;
                }
                for (int64_t h = task * per_task; h < (task + 1) * per_task; h++) {
                    const int64_t base = (slot * kv_heads + h / G) * max_len;
                    const float *K = keys + base * D, *V = values + base * D;
                    for (int64_t r = 0; r < rows; r++)
                        attend_row(q + (row0 + r) * q_stride + h * D, K, V, D, start + r, window, scale, vector, scores,
                                   out + (row0 + r) * heads * D + h * D);
                }
            }
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
