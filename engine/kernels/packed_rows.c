/*
 * The register paths of the packed-weight product (packed_linear.c states
 * the contract and the layout): one row, and two to REGISTER_ROWS rows of
 * Q4_1 or Q8_0 weights, each weight vector decoded into a register and
 * multiplied there, never stored to a buffer. AVX2 and up only: the
 * portable build takes the tiles (packed_tiles.c) at every width.
 *
 * Contract: each output's sum is the same chain of fused multiply-adds in
 * ascending k, on the same decoded floats, as in the tiles, so a row's
 * result is the same bits whichever path computes it.
 */
#include <stdint.h>
#include <string.h>

#include "packed.h"

#ifdef METRALE_AVX2
/* One row: the 64 outputs of a group, decoded straight into registers and
 * multiplied there (no buffer: at one row each weight is used once, and the
 * store and reload of a decoded chunk cost as much as the decode). Each
 * output's sum is the same fused multiply-add chain in ascending k as in the
 * tiles, on the same decoded floats, so the bits are those of any batch.
 * `data` and `scales` point at the group's first block. */
#define STRIPS8(op) op(0) op(1) op(2) op(3) op(4) op(5) op(6) op(7)

/* Column k of a strip's eight rows, decoded into one register, as the
 * register paths (one row, and two to six) take it: Q4_1's column 16 * high + j
 * from `bytes` (the strip's block) and its scales d[8], m[8] at `sc`; Q8_0's
 * column k and its d[8]. The arithmetic of decode_q4_1/decode_q8_0. */
static inline __attribute__((always_inline)) __m256 q4_1_column(
    const uint8_t *bytes, const float *sc, int high, int j) {
    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(bytes + 8 * j)));
    q = high ? _mm256_srli_epi32(q, 4) : _mm256_and_si256(q, _mm256_set1_epi32(0x0F));
    return _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_loadu_ps(sc)), _mm256_loadu_ps(sc + LANES));
}

static inline __attribute__((always_inline)) __m256 q8_0_column(const uint8_t *bytes, const float *sc, int k) {
    const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(bytes + 8 * k)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_loadu_ps(sc));
}

#define ACC_DECLARE(s) __m256 acc##s = _mm256_setzero_ps();
#define ACC_OUT(s) _mm256_storeu_ps(out + (s) * LANES, acc##s);

static void row_group_q4_1(const float *x, int64_t blocks, const uint8_t *data, const float *scales, float *out) {
    STRIPS8(ACC_DECLARE)
    for (int64_t b = 0; b < blocks; b++, x += BLOCK) {
        const uint8_t *bytes = data + b * GROUP * (LANES * BLOCK / 2);
        const float *sc = scales + b * GROUP * 2 * LANES;
#define Q4_STEP(s) acc##s = _mm256_fmadd_ps(xk, q4_1_column(bytes + (s) * 128, sc + (s) * 16, high, j), acc##s);
        for (int high = 0; high < 2; high++) /* k = 0..15 from the low nibbles, then 16..31 */
            for (int j = 0; j < BLOCK / 2; j++) {
                const __m256 xk = _mm256_broadcast_ss(x + 16 * high + j);
                STRIPS8(Q4_STEP)
            }
#undef Q4_STEP
    }
    STRIPS8(ACC_OUT)
}

static void row_group_q8_0(const float *x, int64_t blocks, const uint8_t *data, const float *scales, float *out) {
    STRIPS8(ACC_DECLARE)
    for (int64_t b = 0; b < blocks; b++, x += BLOCK) {
        const uint8_t *bytes = data + b * GROUP * (LANES * BLOCK);
        const float *sc = scales + b * GROUP * LANES;
#define Q8_STEP(s) acc##s = _mm256_fmadd_ps(xk, q8_0_column(bytes + (s) * 256, sc + (s) * LANES, k), acc##s);
        for (int k = 0; k < BLOCK; k++) {
            const __m256 xk = _mm256_broadcast_ss(x + k);
            STRIPS8(Q8_STEP)
        }
#undef Q8_STEP
    }
    STRIPS8(ACC_OUT)
}

static void row_group_bf16(const float *x, int64_t blocks, const uint8_t *data, const float *scales, float *out) {
    (void)scales;
    STRIPS8(ACC_DECLARE)
    for (int64_t b = 0; b < blocks; b++, x += BLOCK) {
        const uint8_t *halves = data + b * GROUP * (2 * LANES * BLOCK);
#define BF16_STEP(s)                                                                                   \
    {                                                                                                  \
        const __m128i h = _mm_loadu_si128((const __m128i *)(halves + (s) * 512 + 16 * k));             \
        const __m256 w = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));         \
        acc##s = _mm256_fmadd_ps(xk, w, acc##s);                                                       \
    }
        for (int k = 0; k < BLOCK; k++) {
            const __m256 xk = _mm256_broadcast_ss(x + k);
            STRIPS8(BF16_STEP)
        }
#undef BF16_STEP
    }
    STRIPS8(ACC_OUT)
}
#undef STRIPS8
#undef ACC_DECLARE
#undef ACC_OUT

typedef void (*row_group_fn)(const float *x, int64_t blocks, const uint8_t *data, const float *scales, float *out);

/* out [N] = x [K] @ decode(weight)^T, one group at a time; a group shared
 * with the other thread is computed whole by both, each keeping its part. */
static void row_product(
    row_group_fn group_product, const float *x, int64_t blocks, const uint8_t *data, const float *scales,
    int64_t block_bytes, int64_t block_scales, int64_t N, int64_t first, int64_t last, float *out) {
    float group_out[COLS];
    for (int64_t s0 = first, s1; s0 < last; s0 = s1) {
        const int64_t group = s0 / GROUP, group_end = (group + 1) * GROUP;
        s1 = last < group_end ? last : group_end;
        const int64_t at = group * blocks * GROUP;
        group_product(x, blocks, data + at * block_bytes, scales + at * block_scales, group_out);
        const int64_t n0 = s0 * LANES, n1 = s1 * LANES < N ? s1 * LANES : N;
        memcpy(out + n0, group_out + (n0 - group * COLS), sizeof(float) * (n1 - n0));
    }
}

/* Two to six rows (eight with AVX-512, below): each decoded weight vector stays in a register and
 * feeds an FMA of every row, so the decode (most of a narrow product's work)
 * is done once for the rows of a verify instead of once into a buffer and
 * read back per tile. R rows x S strips of accumulators (2 x 4, or 3..6 x 2)
 * with S decoded vectors and one broadcast fit the 16 registers. Q4_1 and
 * Q8_0 (bfloat16's decode is a shift: its tiles lose little).
 *
 * One call is one block (32 columns) of S strips: the accumulators come from
 * and go back to `acc` (R rows of COLS, in L1), so the caller walks a group
 * block by block, every strip of a block before the next block, and the
 * weights stream from memory front to back as at one row. (Holding the
 * accumulators over all of K would need a pass per strip pair, and the
 * weights of a model do not stay in the cache from one pass to the next.)
 * Each output's sum is the same chain of fused multiply-adds in ascending k,
 * on the same decoded floats, as in the tiles and the single row: a sum
 * parked in `acc` between blocks is the same float. `data`/`scales` point at
 * the first of the S strips' block; `x` at the block's first column. */
#define RS_EACH(op) \
    op(0, 0) op(0, 1) op(0, 2) op(0, 3) op(1, 0) op(1, 1) op(1, 2) op(1, 3) \
    op(2, 0) op(2, 1) op(3, 0) op(3, 1) op(4, 0) op(4, 1) op(5, 0) op(5, 1)
#define RS_ON(r, s) (R > (r) && S > (s) && ((r) < 2 || (s) < 2))
#define RS_LOAD(r, s) \
    __m256 acc##r##s = RS_ON(r, s) ? _mm256_loadu_ps(acc + (r) * COLS + (s) * LANES) : _mm256_setzero_ps();
#define RS_STORE(r, s) \
    if (RS_ON(r, s)) _mm256_storeu_ps(acc + (r) * COLS + (s) * LANES, acc##r##s);
#define RS_FMA(r, s) \
    if (RS_ON(r, s)) acc##r##s = _mm256_fmadd_ps(_mm256_broadcast_ss(x + (r) * K + k), w##s, acc##r##s);

static inline __attribute__((always_inline)) void rows_q4_1(
    const int R, const int S, const float *x, int64_t K, const uint8_t *bytes, const float *sc, float *acc) {
    RS_EACH(RS_LOAD)
#define Q4_W(s) const __m256 w##s = S > (s) ? q4_1_column(bytes + (s) * 128, sc + (s) * 16, high, j) : _mm256_setzero_ps();
    for (int high = 0; high < 2; high++)
        for (int j = 0; j < BLOCK / 2; j++) {
            const int k = 16 * high + j;
            Q4_W(0) Q4_W(1) Q4_W(2) Q4_W(3)
            RS_EACH(RS_FMA)
        }
#undef Q4_W
    RS_EACH(RS_STORE)
}

static inline __attribute__((always_inline)) void rows_q8_0(
    const int R, const int S, const float *x, int64_t K, const uint8_t *bytes, const float *sc, float *acc) {
    RS_EACH(RS_LOAD)
#define Q8_W(s) const __m256 w##s = S > (s) ? q8_0_column(bytes + (s) * 256, sc + (s) * LANES, k) : _mm256_setzero_ps();
    for (int k = 0; k < BLOCK; k++) {
        Q8_W(0) Q8_W(1) Q8_W(2) Q8_W(3)
        RS_EACH(RS_FMA)
    }
#undef Q8_W
    RS_EACH(RS_STORE)
}
#undef RS_EACH
#undef RS_ON
#undef RS_LOAD
#undef RS_STORE
#undef RS_FMA

static void run_rows(int format, int R, int S, const float *x, int64_t K, const uint8_t *bytes,
                     const float *sc, float *acc) {
#define ROWS_CASE(r, s)                                                          \
    case (r) * 8 + (s):                                                          \
        if (format == FORMAT_Q4_1) rows_q4_1(r, s, x, K, bytes, sc, acc);        \
        else rows_q8_0(r, s, x, K, bytes, sc, acc);                              \
        break;
    switch (R * 8 + S) {
        ROWS_CASE(2, 1) ROWS_CASE(2, 2) ROWS_CASE(2, 3) ROWS_CASE(2, 4)
        ROWS_CASE(3, 1) ROWS_CASE(3, 2) ROWS_CASE(4, 1) ROWS_CASE(4, 2)
        ROWS_CASE(5, 1) ROWS_CASE(5, 2) ROWS_CASE(6, 1) ROWS_CASE(6, 2)
    default: break; /* unreachable: rows_product() asks only for these */
    }
#undef ROWS_CASE
}

#ifdef METRALE_AVX512
/* The register paths again with AVX-512 (module doc, "Wider registers"):
 * column k of strips s and s + 1 decoded into one 16-wide register, strip s
 * in lanes 0-7, by the same arithmetic per lane as q4_1_column and
 * q8_0_column. A pair's bytes lie one strip block apart. */
static inline __attribute__((always_inline)) __m128i pair_bytes(const uint8_t *first, int64_t apart) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)first), _mm_loadl_epi64((const __m128i *)(first + apart)));
}

/* Q4_1's d and m of a pair from its two strips' scales, d[8] m[8] each. */
static inline __attribute__((always_inline)) void q4_1_pair_scales(const float *sc, __m512 *d, __m512 *m) {
    const __m512 a = _mm512_loadu_ps(sc), b = _mm512_loadu_ps(sc + 2 * LANES);
    *d = _mm512_shuffle_f32x4(a, b, 0x44); /* a's d, b's d */
    *m = _mm512_shuffle_f32x4(a, b, 0xEE); /* a's m, b's m */
}

static inline __attribute__((always_inline)) __m512 q4_1_pair_column(
    const uint8_t *bytes, __m512 d, __m512 m, int high, int j) {
    __m512i q = _mm512_cvtepu8_epi32(pair_bytes(bytes + 8 * j, LANES * BLOCK / 2));
    q = high ? _mm512_srli_epi32(q, 4) : _mm512_and_si512(q, _mm512_set1_epi32(0x0F));
    return _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), d), m);
}

/* Q8_0's d of a pair is its two strips' d[8], side by side already. */
static inline __attribute__((always_inline)) __m512 q8_0_pair_column(const uint8_t *bytes, __m512 d, int k) {
    const __m512i q = _mm512_cvtepi8_epi32(pair_bytes(bytes + 8 * k, LANES * BLOCK));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(q), d);
}

#define PAIRS(op) op(0) op(1) op(2) op(3)
#define PACC_DECLARE(p) __m512 acc##p = _mm512_setzero_ps();
#define PACC_OUT(p) _mm512_storeu_ps(out + (p) * 2 * LANES, acc##p);

/* One row, a group's 8 strips as 4 pairs: row_group_q4_1 and the others. */
static void row_group_q4_1_pairs(const float *x, int64_t blocks, const uint8_t *data, const float *scales, float *out) {
    PAIRS(PACC_DECLARE)
    for (int64_t b = 0; b < blocks; b++, x += BLOCK) {
        const uint8_t *bytes = data + b * GROUP * (LANES * BLOCK / 2);
        const float *sc = scales + b * GROUP * 2 * LANES;
#define Q4_SCALES(p) __m512 d##p, m##p; q4_1_pair_scales(sc + (p) * 4 * LANES, &d##p, &m##p);
#define Q4_STEP(p) acc##p = _mm512_fmadd_ps(xk, q4_1_pair_column(bytes + (p) * LANES * BLOCK, d##p, m##p, high, j), acc##p);
        PAIRS(Q4_SCALES)
        for (int high = 0; high < 2; high++)
            for (int j = 0; j < BLOCK / 2; j++) {
                const __m512 xk = _mm512_set1_ps(x[16 * high + j]);
                PAIRS(Q4_STEP)
            }
#undef Q4_SCALES
#undef Q4_STEP
    }
    PAIRS(PACC_OUT)
}

static void row_group_q8_0_pairs(const float *x, int64_t blocks, const uint8_t *data, const float *scales, float *out) {
    PAIRS(PACC_DECLARE)
    for (int64_t b = 0; b < blocks; b++, x += BLOCK) {
        const uint8_t *bytes = data + b * GROUP * (LANES * BLOCK);
        const float *sc = scales + b * GROUP * LANES;
#define Q8_SCALES(p) const __m512 d##p = _mm512_loadu_ps(sc + (p) * 2 * LANES);
#define Q8_STEP(p) acc##p = _mm512_fmadd_ps(xk, q8_0_pair_column(bytes + (p) * 2 * LANES * BLOCK, d##p, k), acc##p);
        PAIRS(Q8_SCALES)
        for (int k = 0; k < BLOCK; k++) {
            const __m512 xk = _mm512_set1_ps(x[k]);
            PAIRS(Q8_STEP)
        }
#undef Q8_SCALES
#undef Q8_STEP
    }
    PAIRS(PACC_OUT)
}

static void row_group_bf16_pairs(const float *x, int64_t blocks, const uint8_t *data, const float *scales, float *out) {
    (void)scales;
    PAIRS(PACC_DECLARE)
    for (int64_t b = 0; b < blocks; b++, x += BLOCK) {
        const uint8_t *halves = data + b * GROUP * (2 * LANES * BLOCK);
#define BF16_STEP(p)                                                                                       \
    {                                                                                                      \
        const uint8_t *at = halves + (p) * 4 * LANES * BLOCK + 16 * k;                                     \
        const __m256i h = _mm256_inserti128_si256(                                                         \
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)at)),                                  \
            _mm_loadu_si128((const __m128i *)(at + 2 * LANES * BLOCK)), 1);                                \
        const __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));             \
        acc##p = _mm512_fmadd_ps(xk, w, acc##p);                                                           \
    }
        for (int k = 0; k < BLOCK; k++) {
            const __m512 xk = _mm512_set1_ps(x[k]);
            PAIRS(BF16_STEP)
        }
#undef BF16_STEP
    }
    PAIRS(PACC_OUT)
}
#undef PACC_DECLARE
#undef PACC_OUT

/* Two to eight rows x D strip pairs: rows_q4_1 and rows_q8_0 with 16-wide
 * registers. D is 4 (the whole group) up to 3 rows and 2 beyond: the
 * accumulators, a pair's scales and weight vector each and the broadcast
 * within the 32 registers. */
#define RZ_EACH(op) \
    op(0, 0) op(0, 1) op(0, 2) op(0, 3) op(1, 0) op(1, 1) op(1, 2) op(1, 3) \
    op(2, 0) op(2, 1) op(2, 2) op(2, 3) op(3, 0) op(3, 1) op(4, 0) op(4, 1) \
    op(5, 0) op(5, 1) op(6, 0) op(6, 1) op(7, 0) op(7, 1)
#define RZ_ON(r, p) (R > (r) && D > (p) && ((r) < 3 || (p) < 2))
#define RZ_LOAD(r, p) \
    __m512 acc##r##p = RZ_ON(r, p) ? _mm512_loadu_ps(acc + (r) * COLS + (p) * 2 * LANES) : _mm512_setzero_ps();
#define RZ_STORE(r, p) \
    if (RZ_ON(r, p)) _mm512_storeu_ps(acc + (r) * COLS + (p) * 2 * LANES, acc##r##p);
#define RZ_FMA(r, p) \
    if (RZ_ON(r, p)) acc##r##p = _mm512_fmadd_ps(_mm512_set1_ps(x[(r) * K + k]), w##p, acc##r##p);

static inline __attribute__((always_inline)) void rows_q4_1_pairs(
    const int R, const int D, const float *x, int64_t K, const uint8_t *bytes, const float *sc, float *acc) {
    RZ_EACH(RZ_LOAD)
    __m512 d0 = _mm512_setzero_ps(), m0 = d0, d1 = d0, m1 = d0, d2 = d0, m2 = d0, d3 = d0, m3 = d0;
#define Q4_SCALES(p) if (D > (p)) q4_1_pair_scales(sc + (p) * 4 * LANES, &d##p, &m##p);
#define Q4_W(p) const __m512 w##p = D > (p) ? q4_1_pair_column(bytes + (p) * LANES * BLOCK, d##p, m##p, high, j) : _mm512_setzero_ps();
    PAIRS(Q4_SCALES)
    for (int high = 0; high < 2; high++)
        for (int j = 0; j < BLOCK / 2; j++) {
            const int k = 16 * high + j;
            PAIRS(Q4_W)
            RZ_EACH(RZ_FMA)
        }
#undef Q4_SCALES
#undef Q4_W
    RZ_EACH(RZ_STORE)
}

static inline __attribute__((always_inline)) void rows_q8_0_pairs(
    const int R, const int D, const float *x, int64_t K, const uint8_t *bytes, const float *sc, float *acc) {
    RZ_EACH(RZ_LOAD)
#define Q8_SCALES(p) const __m512 d##p = D > (p) ? _mm512_loadu_ps(sc + (p) * 2 * LANES) : _mm512_setzero_ps();
#define Q8_W(p) const __m512 w##p = D > (p) ? q8_0_pair_column(bytes + (p) * 2 * LANES * BLOCK, d##p, k) : _mm512_setzero_ps();
    PAIRS(Q8_SCALES)
    for (int k = 0; k < BLOCK; k++) {
        PAIRS(Q8_W)
        RZ_EACH(RZ_FMA)
    }
#undef Q8_SCALES
#undef Q8_W
    RZ_EACH(RZ_STORE)
}
#undef PAIRS
#undef RZ_EACH
#undef RZ_ON
#undef RZ_LOAD
#undef RZ_STORE
#undef RZ_FMA

static void run_rows_pairs(int format, int R, int D, const float *x, int64_t K, const uint8_t *bytes,
                           const float *sc, float *acc) {
#define PAIRS_CASE(r, d)                                                          \
    case (r) * 8 + (d):                                                           \
        if (format == FORMAT_Q4_1) rows_q4_1_pairs(r, d, x, K, bytes, sc, acc);   \
        else rows_q8_0_pairs(r, d, x, K, bytes, sc, acc);                         \
        break;
    switch (R * 8 + D) {
        PAIRS_CASE(2, 1) PAIRS_CASE(2, 2) PAIRS_CASE(2, 3) PAIRS_CASE(2, 4)
        PAIRS_CASE(3, 1) PAIRS_CASE(3, 2) PAIRS_CASE(3, 3) PAIRS_CASE(3, 4)
        PAIRS_CASE(4, 1) PAIRS_CASE(4, 2) PAIRS_CASE(5, 1) PAIRS_CASE(5, 2)
        PAIRS_CASE(6, 1) PAIRS_CASE(6, 2) PAIRS_CASE(7, 1) PAIRS_CASE(7, 2)
        PAIRS_CASE(8, 1) PAIRS_CASE(8, 2)
    default: break; /* unreachable: rows_product() asks only for these */
    }
#undef PAIRS_CASE
}
#endif

/* out [M, N] for 2 <= M <= REGISTER_ROWS over this thread's strips [first, last): per
 * group, its strips of each block in turn, S at a time (module doc above). */
void packed_few_rows(int format, const float *x, int64_t M, int64_t K, int64_t blocks,
                         const uint8_t *data, const float *scales, int64_t block_bytes,
                         int64_t block_scales, int64_t N, int64_t first, int64_t last, float *out) {
    float acc[REGISTER_ROWS * COLS];
#ifdef METRALE_AVX512
    const int widest = M <= 3 ? 4 : 2; /* strip pairs */
#else
    const int widest = M == 2 ? 4 : 2;
#endif
    for (int64_t s0 = first, s1; s0 < last; s0 = s1) {
        const int64_t group = s0 / GROUP, group_end = (group + 1) * GROUP;
        s1 = last < group_end ? last : group_end;
        const int count = (int)(s1 - s0);
        memset(acc, 0, sizeof(float) * (size_t)M * COLS);
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t at = (group * blocks + b) * GROUP + s0 % GROUP;
#ifdef METRALE_AVX512
            int c = 0;
            for (int pairs; (pairs = (count - c) / 2) > 0; c += 2 * pairs) {
                pairs = pairs < widest ? pairs : widest;
                run_rows_pairs(format, (int)M, pairs, x + b * BLOCK, K, data + (at + c) * block_bytes,
                               scales + (at + c) * block_scales, acc + c * LANES);
            }
            if (c < count) { /* an odd strip left: the 8-wide path, at most 6 rows a call */
                const int64_t lead = M <= 6 ? M : 4; /* rows of the first call */
                const uint8_t *bytes = data + (at + c) * block_bytes;
                const float *sc = scales + (at + c) * block_scales;
                run_rows(format, (int)lead, 1, x + b * BLOCK, K, bytes, sc, acc + c * LANES);
                if (M > lead)
                    run_rows(format, (int)(M - lead), 1, x + lead * K + b * BLOCK, K, bytes, sc,
                             acc + lead * COLS + c * LANES);
            }
#else
            for (int c = 0; c < count; c += widest) {
                const int S = count - c < widest ? count - c : widest;
                run_rows(format, (int)M, S, x + b * BLOCK, K, data + (at + c) * block_bytes,
                         scales + (at + c) * block_scales, acc + c * LANES);
            }
#endif
        }
        const int64_t n0 = s0 * LANES, width = N - n0 < count * LANES ? N - n0 : count * LANES;
        for (int64_t m = 0; m < M; m++) memcpy(out + m * N + n0, acc + m * COLS, sizeof(float) * width);
    }
}

/* One row over this thread's strips [first, last) (packed.h): the group
 * product of the format, by strip pairs with AVX-512. */
void packed_one_row(int format, const float *x, int64_t blocks, const uint8_t *data, const float *scales,
                    int64_t block_bytes, int64_t block_scales, int64_t N, int64_t first, int64_t last,
                    float *out) {
#ifdef METRALE_AVX512
    const row_group_fn group_product = format == FORMAT_Q4_1   ? row_group_q4_1_pairs
                                       : format == FORMAT_Q8_0 ? row_group_q8_0_pairs
                                                               : row_group_bf16_pairs;
#else
    const row_group_fn group_product = format == FORMAT_Q4_1   ? row_group_q4_1
                                       : format == FORMAT_Q8_0 ? row_group_q8_0
                                                               : row_group_bf16;
#endif
    row_product(group_product, x, blocks, data, scales, block_bytes, block_scales, N, first, last, out);
}
#endif
