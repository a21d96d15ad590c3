/*
 * The few-row register path's kernel of one block (packed_rows.c walks the
 * blocks and calls it): its template, instantiated per format and shape by
 * ROWS_OF in packed_rows.c and packed_rows_bits.c. Two files, so that a
 * first build compiles the instantiations on two cores at once.
 */
#ifndef METRALE_PACKED_ROWS_H
#define METRALE_PACKED_ROWS_H
#include <stdint.h>

#include "packed_columns.h"

#ifdef METRALE_AVX2
/* Two to six rows: each decoded weight vector stays in a register and
 * feeds an FMA of every row, so the decode (most of a narrow product's work)
 * is done once for the rows of a verify instead of once into a buffer and
 * read back per tile. R rows x S strips of accumulators (2 x 4, or 3..6 x 2)
 * with S decoded vectors and one broadcast fit the 16 registers.
 *
 * One call is one block (32 columns) of S strips: the accumulators come from
 * and go back to `acc` (R rows of COLS, in L1), so the caller walks a group
 * block by block, every strip of a block before the next block, and the
 * weights stream from memory front to back as at one row. (Holding the
 * accumulators over all of K would need a pass per strip pair, and the
 * weights of a model do not stay in the cache from one pass to the next.)
 * Each output's sum is the same chain of fused multiply-adds in ascending k,
 * on the same decoded floats, as in the tiles and the single row: a sum
 * parked in `acc` between blocks is the same float. `bytes`/`sc` point at
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
#define RS_W(t)                                                                                  \
    const __m256 w##t = S > (t) ? column8(format, bytes + (t) * bytes_apart, sc + (t) * scales_apart, \
                                          high, jb, s)                                            \
                                : _mm256_setzero_ps();

static inline __attribute__((always_inline)) void rows(
    const int format, const int R, const int S, const float *x, int64_t K, const uint8_t *bytes,
    const float *sc, float *acc) {
    const int64_t bytes_apart = strip_block_bytes(format), scales_apart = strip_block_scales(format);
    RS_EACH(RS_LOAD)
    EACH_COLUMN({
        const int k = 16 * high + LANES * jb + s;
        RS_W(0) RS_W(1) RS_W(2) RS_W(3)
        RS_EACH(RS_FMA)
    })
    RS_EACH(RS_STORE)
}
#undef RS_EACH
#undef RS_ON
#undef RS_LOAD
#undef RS_STORE
#undef RS_FMA
#undef RS_W

/* R rows x S strips of one block (the shapes ROWS_OF instantiates). */
typedef void (*rows_fn)(int R, int S, const float *x, int64_t K, const uint8_t *bytes, const float *sc,
                        float *acc);

#define ROWS_CASE(format, r, s) \
    case (r) * 8 + (s): rows(format, r, s, x, K, bytes, sc, acc); break;
#define ROWS_OF(name, format)                                                                          \
    void name(int R, int S, const float *x, int64_t K, const uint8_t *bytes, const float *sc,         \
              float *acc) {                                                                            \
        switch (R * 8 + S) {                                                                           \
            ROWS_CASE(format, 2, 1) ROWS_CASE(format, 2, 2) ROWS_CASE(format, 2, 3)                    \
            ROWS_CASE(format, 2, 4) ROWS_CASE(format, 3, 1) ROWS_CASE(format, 3, 2)                    \
            ROWS_CASE(format, 4, 1) ROWS_CASE(format, 4, 2) ROWS_CASE(format, 5, 1)                    \
            ROWS_CASE(format, 5, 2) ROWS_CASE(format, 6, 1) ROWS_CASE(format, 6, 2)                    \
        default: break; /* unreachable: strips_rows() asks only for these */                           \
        }                                                                                              \
    }

PACKED_INTERNAL void rows_q4_1(int R, int S, const float *x, int64_t K, const uint8_t *bytes, const float *sc,
                               float *acc);
PACKED_INTERNAL void rows_q8_0(int R, int S, const float *x, int64_t K, const uint8_t *bytes, const float *sc,
                               float *acc);
PACKED_INTERNAL void rows_q4_0(int R, int S, const float *x, int64_t K, const uint8_t *bytes, const float *sc,
                               float *acc);
PACKED_INTERNAL void rows_q5_0(int R, int S, const float *x, int64_t K, const uint8_t *bytes, const float *sc,
                               float *acc);
PACKED_INTERNAL void rows_q5_1(int R, int S, const float *x, int64_t K, const uint8_t *bytes, const float *sc,
                               float *acc);
PACKED_INTERNAL void rows_q6_k(int R, int S, const float *x, int64_t K, const uint8_t *bytes, const float *sc,
                               float *acc);
#endif
#endif
