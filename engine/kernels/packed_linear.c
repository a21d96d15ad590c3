/*
 * Linear layers over packed weights, computed in float32.
 *
 * Contract: out[m][n] = sum_k x[m][k] * w[n][k] for x [M, K] float32 and a
 * weight [N, K] kept packed (GGUF Q4_1 or Q8_0 blocks of 32 along K, or
 * bfloat16) in the layout below. A weight value is decoded with
 * exactly the arithmetic gguf's reference dequantizer uses (Q4_1: d * q,
 * rounded, then + m, rounded; Q8_0: d * q; bfloat16: a shift), so the
 * float32 weight this file computes with is bit-for-bit the one `metrale`
 * writes to model.safetensors: the model is the same, only fewer bytes cross
 * the memory bus.
 *
 * Layout (metrale/engine/runtime/packed.py writes it): the weight's rows are
 * taken 64 at a time (a group; the last one padded with zero rows), a group's
 * 8 strips of 8 rows each; within a strip, each block of 32 columns is stored
 * column-major, so that one 8-wide load decodes column k of eight rows:
 *   Q4_1: 16 x 8 bytes, byte [j][n] = q[n][j] | q[n][j + 16] << 4, and the
 *         scales d[8] then m[8];
 *   Q8_0: 32 x 8 signed bytes, and d[8];
 *   bf16: 32 x 8 16-bit values.
 * Blocks are stored [group][block][strip], data and scales in two arrays,
 * so a group reads front to back, one stream for the prefetcher to follow.
 *
 * Why: decoding a small model on a CPU is bound by memory bandwidth at one
 * row and by arithmetic at sixteen. Packed weights cut the bytes (Q4_1 is
 * 0.625 bytes a value against float32's 4). The column-major strips let the
 * product run in broadcast form: a decoded chunk of 64 columns of a group
 * (16 KB) stays in the core's first-level cache while tiles of up to 6 input
 * rows x 16 outputs multiply against it, each step one broadcast input value
 * and a few weight loads feeding up to twelve fused multiply-adds. Up to six
 * rows (eight with AVX-512; a decode step, or a verify of a few drafts) skip
 * the buffer: each
 * decoded vector goes straight from its register into one FMA per row, so a
 * verify of 2 rows costs little more than a step of 1 (the decode, not the
 * FMA, is most of a narrow product's work; a buffer would be stored and read
 * back per tile). At
 * every width from one row to a prefill chunk this beats decoding the whole weight
 * to float32 for a BLAS, which writes 4 bytes a value to memory and reads
 * them back, so prefill chunks run here too.
 *
 * Batch invariance: each output is one running float32 sum, a fused
 * multiply-add per k in ascending order from 0.0, whatever M is and whichever
 * tile computed it (a sum parked in memory between chunks is the same
 * float). A row's result never depends on the rows beside it, so a verify of
 * 4 rows gives the same logits as 4 single-row steps, and a prompt row in a
 * prefill chunk the same as in a step of its own. The portable path sums in
 * the same order with fmaf, so it gives the same bits.
 *
 * Wider registers: where the compiler targets AVX-512 (-march=native on a
 * CPU that has it), the tiles and the register paths hold two strips in one
 * 16-wide register (strip s in lanes 0-7, s + 1 in 8-15: side by side in a
 * decoded chunk already, one strip block apart in the packed bytes) and use
 * the 32 registers for more rows x strips a tile. Twice the lanes per FMA
 * halve the arithmetic each row adds, which is most of a wide verify's and a
 * prefill chunk's work (a one-row step, bound by the decode and the memory
 * bus, gains little). Every lane does what an 8-wide lane does, the same
 * decode and the same FMA chain in ascending k, so a library built with
 * AVX-512 and one built without give the same bits (a test builds both,
 * through binding.kernel_built_with). A strip left over from the pairs takes
 * the 8-wide code.
 *
 * Built on first use by metrale/engine/kernels/binding.py with the system C
 * compiler (-O3 -march=native -fopenmp -ffp-contract=off: no fused
 * multiply-add may merge the two roundings of the Q4_1 decode). OpenMP
 * resolves to the runtime torch has already loaded, so both share one
 * thread pool.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define METRALE_AVX2 1
#if defined(__AVX512F__)
#define METRALE_AVX512 1
#endif
#endif
#ifdef METRALE_AVX512
#define REGISTER_ROWS 8 /* rows the register paths take (2 and up); more go to the tiles */
#else
#define REGISTER_ROWS 6
#endif

enum { FORMAT_Q4_1 = 0, FORMAT_Q8_0 = 1, FORMAT_BF16 = 2 };
enum {
    LANES = 8,        /* rows of a strip: one 8-wide vector */
    BLOCK = 32,       /* columns of a quantization block */
    GROUP = 8,        /* strips decoded together: 64 outputs */
    COLS = GROUP * LANES,
    CHUNK_BLOCKS = 2, /* blocks decoded at a time: 64 columns, 16 KB of floats */
    TILE_ROWS = 6,
};

/* Decodes one block of `count` consecutive strips: out[k * ld + 8 s + n] =
 * w[8 s + n][k] for k < 32, n < 8, s < count. `data` and `scales` point at
 * the first strip's block bytes and scales (the strips' follow on). One call
 * per block and group, not per strip: the calls cost more than the loop. */
typedef void (*decode_block_fn)(const uint8_t *data, const float *scales, int count, float *out, int64_t ld);

static void decode_q4_1(const uint8_t *data, const float *scales, int count, float *out, int64_t ld) {
    for (int strip = 0; strip < count; strip++, data += LANES * BLOCK / 2, scales += 2 * LANES, out += LANES) {
#ifdef METRALE_AVX2
    const __m256 d = _mm256_loadu_ps(scales), m = _mm256_loadu_ps(scales + LANES);
    const __m128i low_nibble = _mm_set1_epi8(0x0F);
    for (int j = 0; j < BLOCK / 2; j++) {
        const __m128i bytes = _mm_loadl_epi64((const __m128i *)(data + LANES * j));
        const __m128i lo = _mm_and_si128(bytes, low_nibble);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibble);
        const __m256 qlo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        const __m256 qhi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        _mm256_storeu_ps(out + j * ld, _mm256_add_ps(_mm256_mul_ps(qlo, d), m));
        _mm256_storeu_ps(out + (j + BLOCK / 2) * ld, _mm256_add_ps(_mm256_mul_ps(qhi, d), m));
    }
#else
    for (int j = 0; j < BLOCK / 2; j++)
        for (int n = 0; n < LANES; n++) {
            const uint8_t byte = data[LANES * j + n];
            out[j * ld + n] = (float)(byte & 0x0F) * scales[n] + scales[LANES + n];
            out[(j + BLOCK / 2) * ld + n] = (float)(byte >> 4) * scales[n] + scales[LANES + n];
        }
#endif
    }
}

static void decode_q8_0(const uint8_t *data, const float *scales, int count, float *out, int64_t ld) {
    for (int strip = 0; strip < count; strip++, data += LANES * BLOCK, scales += LANES, out += LANES) {
    const int8_t *q = (const int8_t *)data;
#ifdef METRALE_AVX2
    const __m256 d = _mm256_loadu_ps(scales);
    for (int k = 0; k < BLOCK; k++) {
        const __m128i bytes = _mm_loadl_epi64((const __m128i *)(q + LANES * k));
        _mm256_storeu_ps(out + k * ld, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), d));
    }
#else
    for (int k = 0; k < BLOCK; k++)
        for (int n = 0; n < LANES; n++) out[k * ld + n] = (float)q[LANES * k + n] * scales[n];
#endif
    }
}

static void decode_bf16(const uint8_t *data, const float *scales, int count, float *out, int64_t ld) {
    (void)scales; /* bfloat16 has none: callers pass a valid dummy pointer */
    for (int strip = 0; strip < count; strip++, data += 2 * LANES * BLOCK, out += LANES) {
#ifdef METRALE_AVX2
    for (int k = 0; k < BLOCK; k++) {
        const __m128i halves = _mm_loadu_si128((const __m128i *)(data + 2 * LANES * k));
        const __m256i bits = _mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16);
        _mm256_storeu_ps(out + k * ld, _mm256_castsi256_ps(bits));
    }
#else
    const uint16_t *h = (const uint16_t *)data;
    for (int k = 0; k < BLOCK; k++)
        for (int n = 0; n < LANES; n++) {
            const uint32_t bits = (uint32_t)h[LANES * k + n] << 16;
            memcpy(out + k * ld + n, &bits, sizeof bits);
        }
#endif
    }
}

/* The decoder of `format` and the size of one strip block: its bytes and
 * its scales. NULL for an unknown format. */
static decode_block_fn decoder(int format, int64_t *block_bytes, int64_t *block_scales) {
    switch (format) {
    case FORMAT_Q4_1: *block_bytes = LANES * BLOCK / 2; *block_scales = 2 * LANES; return decode_q4_1;
    case FORMAT_Q8_0: *block_bytes = LANES * BLOCK; *block_scales = LANES; return decode_q8_0;
    case FORMAT_BF16: *block_bytes = 2 * LANES * BLOCK; *block_scales = 0; return decode_bf16;
    default: return NULL;
    }
}

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
 * strips. */
static void product(const float *x, int64_t M, int64_t K, const float *w, int kc, int strips, float *acc) {
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
static void rows_product(int format, const float *x, int64_t M, int64_t K, int64_t blocks,
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

#endif

/* Floats in one of the register paths' vectors: 16 with AVX-512, 8 with AVX2,
 * 1 in the portable code (tests check which paths a build took). */
int metrale_vector_lanes(void) {
#if defined(METRALE_AVX512)
    return 2 * LANES;
#elif defined(METRALE_AVX2)
    return LANES;
#else
    return 1;
#endif
}

/* out [M, N] = x [M, K] @ decode(weight)^T. Returns 0, or -1 for a bad
 * format or a K that is not a multiple of 32, or -2 when out of memory. */
int metrale_packed_linear(
    int format, const float *x, int64_t M, int64_t K, const uint8_t *data, const float *scales,
    int64_t N, float *out, int threads) {
    int64_t block_bytes, block_scales;
    const decode_block_fn decode = decoder(format, &block_bytes, &block_scales);
    if (decode == NULL || K % BLOCK != 0) return -1;
    if (M == 0) return 0;
    const int64_t strips = (N + LANES - 1) / LANES, blocks = K / BLOCK;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        /* Each thread takes an even share of the strips, not of whole groups:
         * a 576-wide layer is 9 groups, which two threads would split 5:4. */
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t first = strips * me / team;
        const int64_t last = strips * (me + 1) / team;
#ifdef METRALE_AVX2
        if (M == 1) {
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
            first = last; /* nothing left for the tiles */
        } else if (M <= REGISTER_ROWS && format != FORMAT_BF16) {
            rows_product(format, x, M, K, blocks, data, scales, block_bytes, block_scales, N, first, last, out);
            first = last;
        }
#endif
        const int tiles = first < last; /* the row path may have done it all */
        float *buf = tiles ? aligned_alloc(64, sizeof(float) * CHUNK_BLOCKS * BLOCK * COLS) : NULL;
        float *acc = tiles ? aligned_alloc(64, sizeof(float) * (size_t)M * COLS) : NULL;
        failed = tiles && (buf == NULL || acc == NULL);
        for (int64_t s0 = first, s1; s0 < last && !failed; s0 = s1) {
            const int64_t group = s0 / GROUP, group_end = (group + 1) * GROUP;
            s1 = last < group_end ? last : group_end; /* this thread's strips of the group */
            const int count = (int)(s1 - s0);
            memset(acc, 0, sizeof(float) * (size_t)M * COLS);
            for (int64_t b0 = 0; b0 < blocks; b0 += CHUNK_BLOCKS) {
                const int chunk = (int)(blocks - b0 < CHUNK_BLOCKS ? blocks - b0 : CHUNK_BLOCKS);
                for (int b = 0; b < chunk; b++) {
                    const int64_t at = (group * blocks + b0 + b) * GROUP + s0 % GROUP;
                    decode(data + at * block_bytes, scales + at * block_scales, count, buf + b * BLOCK * COLS, COLS);
                }
                product(x + b0 * BLOCK, M, K, buf, chunk * BLOCK, count, acc);
            }
            const int64_t n0 = s0 * LANES, width = N - n0 < count * LANES ? N - n0 : count * LANES;
            for (int64_t m = 0; m < M; m++) memcpy(out + m * N + n0, acc + m * COLS, sizeof(float) * width);
        }
        free(buf);
        free(acc);
    }
    return failed ? -2 : 0;
}

/* out [N, K] = decode(weight) in row-major order: for training (the frozen
 * LM head) and for tests. */
int metrale_decode(int format, int64_t K, const uint8_t *data, const float *scales, int64_t N, float *out, int threads) {
    int64_t block_bytes, block_scales;
    const decode_block_fn decode = decoder(format, &block_bytes, &block_scales);
    if (decode == NULL || K % BLOCK != 0) return -1;
    const int64_t strips = (N + LANES - 1) / LANES, blocks = K / BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t s = 0; s < strips; s++) {
        float block[BLOCK * LANES]; /* [k][n] */
        const int rows = (int)(N - s * LANES < LANES ? N - s * LANES : LANES);
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t at = (s / GROUP * blocks + b) * GROUP + s % GROUP;
            decode(data + at * block_bytes, scales + at * block_scales, 1, block, LANES);
            for (int n = 0; n < rows; n++) {
                float *row = out + (s * LANES + n) * K + b * BLOCK;
                for (int k = 0; k < BLOCK; k++) row[k] = block[k * LANES + n];
            }
        }
    }
    return 0;
}
