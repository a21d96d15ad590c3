/*
 * The tiles of the packed-weight product (packed_linear.c states the
 * contract and the layout): a decoded chunk of a group's weights times the
 * input rows, tile by tile, for the widths the register paths
 * (packed_rows.c) do not take: more than REGISTER_ROWS rows (a prefill
 * chunk or a wide verify), and bfloat16 weights beyond one row.
 *
 * Contract: packed_tiles adds to each output one fused multiply-add per
 * column in ascending order, on the decoded floats, whichever tile shape
 * takes it, so a row's sums are those of the register paths and of any
 * batch (packed_linear.c, "Batch invariance").
 */
#include <math.h>
#include <stdint.h>

#include "packed.h"

/* acc[r][c] += sum over k < kc of x[r][k] * w[k][c] for the R rows of a
 * tile and the 8 S columns of its strips, one fused multiply-add per k in
 * ascending order. x has row stride K, w and acc COLS.
 *
 * Tile shapes: R x S accumulators, at most 12 (with the weight vectors and
 * the broadcast, within 16 registers) and at least 8 wherever the strips
 * allow, so both FMA pipes stay busy through their latency: 1x8, 2x4, 3x4,
 * 4x3, then 5 or 6 rows x 2. The accumulators are named variables, not an array:
 * gcc keeps an array's home on the stack and stores it on every step. */
#ifdef METRALE_AVX2
#define ACC_LOAD(a, r, s) \
    if (R > (r) && S > (s)) a = _mm256_loadu_ps(acc + (r) * COLS + (s) * LANES);
#define ACC_STORE(a, r, s) \
    if (R > (r) && S > (s)) _mm256_storeu_ps(acc + (r) * COLS + (s) * LANES, a);
#define ACC_FMA(a, r, s) \
    if (R > (r) && S > (s)) a = _mm256_fmadd_ps(xb, w##s, a);
/* Row r's broadcast, then its FMAs: one broadcast register live at a time
 * (all six at once would push accumulators out to the stack). */
#define ROW(r, fmas) \
    if (R > (r)) {                                              \
        const __m256 xb = _mm256_broadcast_ss(x + (r) * K + k); \
        fmas                                                    \
    }
#define WEIGHT(s) \
    const __m256 w##s = S > (s) ? _mm256_loadu_ps(w + k * COLS + (s) * LANES) : _mm256_setzero_ps();

/* Up to 6 rows x 2 strips. */
static inline __attribute__((always_inline)) void tile_narrow(
    const int R, const int S, const float *x, int64_t K, const float *w, int kc, float *acc) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
    __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
#define EACH(op) \
    op(a00, 0, 0) op(a01, 0, 1) op(a10, 1, 0) op(a11, 1, 1) op(a20, 2, 0) op(a21, 2, 1) \
    op(a30, 3, 0) op(a31, 3, 1) op(a40, 4, 0) op(a41, 4, 1) op(a50, 5, 0) op(a51, 5, 1)
    EACH(ACC_LOAD)
    for (int k = 0; k < kc; k++) {
        WEIGHT(0) WEIGHT(1)
        ROW(0, ACC_FMA(a00, 0, 0) ACC_FMA(a01, 0, 1))
        ROW(1, ACC_FMA(a10, 1, 0) ACC_FMA(a11, 1, 1))
        ROW(2, ACC_FMA(a20, 2, 0) ACC_FMA(a21, 2, 1))
        ROW(3, ACC_FMA(a30, 3, 0) ACC_FMA(a31, 3, 1))
        ROW(4, ACC_FMA(a40, 4, 0) ACC_FMA(a41, 4, 1))
        ROW(5, ACC_FMA(a50, 5, 0) ACC_FMA(a51, 5, 1))
    }
    EACH(ACC_STORE)
#undef EACH
}

/* Up to 3 rows x 4 strips. */
static inline __attribute__((always_inline)) void tile_wide(
    const int R, const int S, const float *x, int64_t K, const float *w, int kc, float *acc) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00;
    __m256 a12 = a00, a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00;
#define EACH(op) \
    op(a00, 0, 0) op(a01, 0, 1) op(a02, 0, 2) op(a03, 0, 3) op(a10, 1, 0) op(a11, 1, 1) \
    op(a12, 1, 2) op(a13, 1, 3) op(a20, 2, 0) op(a21, 2, 1) op(a22, 2, 2) op(a23, 2, 3)
    EACH(ACC_LOAD)
    for (int k = 0; k < kc; k++) {
        WEIGHT(0) WEIGHT(1) WEIGHT(2) WEIGHT(3)
        ROW(0, ACC_FMA(a00, 0, 0) ACC_FMA(a01, 0, 1) ACC_FMA(a02, 0, 2) ACC_FMA(a03, 0, 3))
        ROW(1, ACC_FMA(a10, 1, 0) ACC_FMA(a11, 1, 1) ACC_FMA(a12, 1, 2) ACC_FMA(a13, 1, 3))
        ROW(2, ACC_FMA(a20, 2, 0) ACC_FMA(a21, 2, 1) ACC_FMA(a22, 2, 2) ACC_FMA(a23, 2, 3))
    }
    EACH(ACC_STORE)
#undef EACH
}

/* Four rows x up to 3 strips. */
static inline __attribute__((always_inline)) void tile_square(
    const int R, const int S, const float *x, int64_t K, const float *w, int kc, float *acc) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a10 = a00, a11 = a00, a12 = a00;
    __m256 a20 = a00, a21 = a00, a22 = a00, a30 = a00, a31 = a00, a32 = a00;
#define EACH(op) \
    op(a00, 0, 0) op(a01, 0, 1) op(a02, 0, 2) op(a10, 1, 0) op(a11, 1, 1) op(a12, 1, 2) \
    op(a20, 2, 0) op(a21, 2, 1) op(a22, 2, 2) op(a30, 3, 0) op(a31, 3, 1) op(a32, 3, 2)
    EACH(ACC_LOAD)
    for (int k = 0; k < kc; k++) {
        WEIGHT(0) WEIGHT(1) WEIGHT(2)
        ROW(0, ACC_FMA(a00, 0, 0) ACC_FMA(a01, 0, 1) ACC_FMA(a02, 0, 2))
        ROW(1, ACC_FMA(a10, 1, 0) ACC_FMA(a11, 1, 1) ACC_FMA(a12, 1, 2))
        ROW(2, ACC_FMA(a20, 2, 0) ACC_FMA(a21, 2, 1) ACC_FMA(a22, 2, 2))
        ROW(3, ACC_FMA(a30, 3, 0) ACC_FMA(a31, 3, 1) ACC_FMA(a32, 3, 2))
    }
    EACH(ACC_STORE)
#undef EACH
}

/* One row x 8 strips. */
static inline __attribute__((always_inline)) void tile_row(
    const int R, const int S, const float *x, int64_t K, const float *w, int kc, float *acc) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
    __m256 a04 = a00, a05 = a00, a06 = a00, a07 = a00;
#define EACH(op) \
    op(a00, 0, 0) op(a01, 0, 1) op(a02, 0, 2) op(a03, 0, 3) \
    op(a04, 0, 4) op(a05, 0, 5) op(a06, 0, 6) op(a07, 0, 7)
    EACH(ACC_LOAD)
    for (int k = 0; k < kc; k++) {
        WEIGHT(0) WEIGHT(1) WEIGHT(2) WEIGHT(3) WEIGHT(4) WEIGHT(5) WEIGHT(6) WEIGHT(7)
        ROW(0, ACC_FMA(a00, 0, 0) ACC_FMA(a01, 0, 1) ACC_FMA(a02, 0, 2) ACC_FMA(a03, 0, 3)
               ACC_FMA(a04, 0, 4) ACC_FMA(a05, 0, 5) ACC_FMA(a06, 0, 6) ACC_FMA(a07, 0, 7))
    }
    EACH(ACC_STORE)
#undef EACH
}
#undef ACC_LOAD
#undef ACC_STORE
#undef ACC_FMA
#undef ROW
#undef WEIGHT

static void run_tile(int R, int S, const float *x, int64_t K, const float *w, int kc, float *acc) {
#define TILE_CASE(kind, r, s) \
    case (r) * 16 + (s): kind(r, s, x, K, w, kc, acc); break;
    switch (R * 16 + S) {
        TILE_CASE(tile_row, 1, 8) TILE_CASE(tile_wide, 1, 4) TILE_CASE(tile_narrow, 1, 2)
        TILE_CASE(tile_narrow, 1, 1) TILE_CASE(tile_wide, 2, 4) TILE_CASE(tile_narrow, 2, 2)
        TILE_CASE(tile_narrow, 2, 1) TILE_CASE(tile_wide, 3, 4) TILE_CASE(tile_narrow, 3, 2)
        TILE_CASE(tile_narrow, 3, 1) TILE_CASE(tile_square, 4, 3) TILE_CASE(tile_narrow, 4, 2)
        TILE_CASE(tile_narrow, 4, 1)
        TILE_CASE(tile_narrow, 5, 2) TILE_CASE(tile_narrow, 5, 1) TILE_CASE(tile_narrow, 6, 2)
        TILE_CASE(tile_narrow, 6, 1)
    default: break; /* unreachable: product() asks only for the shapes above */
    }
#undef TILE_CASE
}
#else
static void run_tile(int R, int S, const float *x, int64_t K, const float *w, int kc, float *acc) {
    for (int k = 0; k < kc; k++)
        for (int r = 0; r < R; r++)
            for (int c = 0; c < S * LANES; c++)
                acc[r * COLS + c] = fmaf(x[r * K + k], w[k * COLS + c], acc[r * COLS + c]);
}
#endif

#ifdef METRALE_AVX512
/* AVX-512 (module doc, "Wider registers"): R rows x D strip pairs, each pair
 * one 16-wide accumulator (strips s and s + 1 side by side, as the decoded
 * chunk holds them). Up to 6 x 4 accumulators, the 4 weight vectors and the
 * broadcast fit the 32 registers. */
#define TZ_EACH(op) \
    op(0, 0) op(0, 1) op(0, 2) op(0, 3) op(1, 0) op(1, 1) op(1, 2) op(1, 3) \
    op(2, 0) op(2, 1) op(2, 2) op(2, 3) op(3, 0) op(3, 1) op(3, 2) op(3, 3) \
    op(4, 0) op(4, 1) op(4, 2) op(4, 3) op(5, 0) op(5, 1) op(5, 2) op(5, 3)
#define TZ_ON(r, p) (R > (r) && D > (p))
#define TZ_LOAD(r, p) \
    __m512 z##r##p = TZ_ON(r, p) ? _mm512_loadu_ps(acc + (r) * COLS + (p) * 2 * LANES) : _mm512_setzero_ps();
#define TZ_STORE(r, p) \
    if (TZ_ON(r, p)) _mm512_storeu_ps(acc + (r) * COLS + (p) * 2 * LANES, z##r##p);
#define TZ_FMA(r, p) \
    if (TZ_ON(r, p)) z##r##p = _mm512_fmadd_ps(xb, w##p, z##r##p);
#define TZ_ROW(r) \
    if (R > (r)) {                                                      \
        const __m512 xb = _mm512_set1_ps(x[(r) * K + k]);               \
        TZ_FMA(r, 0) TZ_FMA(r, 1) TZ_FMA(r, 2) TZ_FMA(r, 3)             \
    }
#define TZ_W(p) \
    const __m512 w##p = D > (p) ? _mm512_loadu_ps(w + k * COLS + (p) * 2 * LANES) : _mm512_setzero_ps();

static inline __attribute__((always_inline)) void tile_pairs(
    const int R, const int D, const float *x, int64_t K, const float *w, int kc, float *acc) {
    TZ_EACH(TZ_LOAD)
    for (int k = 0; k < kc; k++) {
        TZ_W(0) TZ_W(1) TZ_W(2) TZ_W(3)
        TZ_ROW(0) TZ_ROW(1) TZ_ROW(2) TZ_ROW(3) TZ_ROW(4) TZ_ROW(5)
    }
    TZ_EACH(TZ_STORE)
}
#undef TZ_EACH
#undef TZ_ON
#undef TZ_LOAD
#undef TZ_STORE
#undef TZ_FMA
#undef TZ_ROW
#undef TZ_W

static void run_tile_pairs(int R, int D, const float *x, int64_t K, const float *w, int kc, float *acc) {
#define PAIR_CASE(r, d) \
    case (r) * 8 + (d): tile_pairs(r, d, x, K, w, kc, acc); break;
#define PAIR_ROWS(r) PAIR_CASE(r, 1) PAIR_CASE(r, 2) PAIR_CASE(r, 3) PAIR_CASE(r, 4)
    switch (R * 8 + D) {
        PAIR_ROWS(1) PAIR_ROWS(2) PAIR_ROWS(3) PAIR_ROWS(4) PAIR_ROWS(5) PAIR_ROWS(6)
    default: break; /* unreachable: product() asks only for these */
    }
#undef PAIR_ROWS
#undef PAIR_CASE
}
#endif

/* acc [M][COLS] += x[:, chunk] @ w, w the decoded chunk [kc][COLS] of `strips`
 * strips (packed.h). */
void packed_tiles(const float *x, int64_t M, int64_t K, const float *w, int kc, int strips, float *acc) {
#ifdef METRALE_AVX512
    for (int64_t m = 0; m < M; m += TILE_ROWS) {
        const int rows = (int)(M - m < TILE_ROWS ? M - m : TILE_ROWS);
        int c = 0;
        for (int pairs; (pairs = (strips - c) / 2) > 0; c += 2 * pairs) {
            pairs = pairs < 4 ? pairs : 4;
            run_tile_pairs(rows, pairs, x + m * K, K, w + c * LANES, kc, acc + m * COLS + c * LANES);
        }
        if (c < strips) /* an odd strip left: the 8-wide tile */
            run_tile(rows, 1, x + m * K, K, w + c * LANES, kc, acc + m * COLS + c * LANES);
    }
#else
    for (int64_t m = 0; m < M; m += TILE_ROWS) {
        const int rows = (int)(M - m < TILE_ROWS ? M - m : TILE_ROWS);
        const int widest = rows == 1 ? 8 : rows <= 3 ? 4 : rows == 4 ? 3 : 2;
        for (int c = 0; c < strips;) {
            int width = widest < strips - c ? widest : strips - c;
            if (rows != 4)
                while (width & (width - 1)) width--; /* 1, 2, 4 or 8 strips; 3 only for 4 rows */
            run_tile(rows, width, x + m * K, K, w + c * LANES, kc, acc + m * COLS + c * LANES);
            c += width;
        }
    }
#endif
}
