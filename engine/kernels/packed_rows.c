/*
 * The register paths of the packed-weight product (packed_linear.c states
 * the contract and the layout): one row, and two to REGISTER_ROWS rows of
 * any format but bfloat16, each weight vector decoded into a register by
 * packed_columns.h's column8 and multiplied there, never stored to a
 * buffer. AVX2 and up only: the portable build takes the tiles
 * (packed_tiles.c) at every width. With AVX-512, Q4_1 and Q8_0 (and
 * bfloat16 at one row) take packed_rows512.c's 16-wide code; every other
 * format this file's 8-wide code.
 *
 * Contract: each output's sum is the same chain of fused multiply-adds in
 * ascending k, on the same decoded floats, as in the tiles, so a row's
 * result is the same bits whichever path computes it.
 *
 * The column loops are EACH_COLUMN's: the decoders' bit shifts depend on
 * the column, and constant ones are immediate operands.
 */
#include <stdint.h>
#include <string.h>

#include "packed_rows.h"

#ifdef METRALE_AVX2
/* One row: the 64 outputs of a group, decoded straight into registers and
 * multiplied there (no buffer: at one row each weight is used once, and the
 * store and reload of a decoded chunk cost as much as the decode). Each
 * output's sum is the same fused multiply-add chain in ascending k as in the
 * tiles, on the same decoded floats, so the bits are those of any batch.
 * `data` and `scales` point at the group's first block. */
#define STRIPS8(op) op(0) op(1) op(2) op(3) op(4) op(5) op(6) op(7)
#define ACC_DECLARE(s) __m256 acc##s = _mm256_setzero_ps();
#define ACC_OUT(s) _mm256_storeu_ps(out + (s) * LANES, acc##s);

static inline __attribute__((always_inline)) void row_group(
    const int format, const float *x, int64_t blocks, const uint8_t *data, const float *scales, float *out) {
    const int64_t bytes_apart = strip_block_bytes(format), scales_apart = strip_block_scales(format);
    STRIPS8(ACC_DECLARE)
    for (int64_t b = 0; b < blocks; b++, x += BLOCK) {
        const uint8_t *bytes = data + b * GROUP * bytes_apart;
        const float *sc = scales + b * GROUP * scales_apart;
#define STEP(t) acc##t = _mm256_fmadd_ps(xk, column8(format, bytes + (t) * bytes_apart, sc + (t) * scales_apart, high, jb, s), acc##t);
        EACH_COLUMN({
            const __m256 xk = _mm256_broadcast_ss(x + 16 * high + LANES * jb + s);
            STRIPS8(STEP)
        })
#undef STEP
    }
    STRIPS8(ACC_OUT)
}
#undef STRIPS8
#undef ACC_DECLARE
#undef ACC_OUT

#define ROW_GROUP(name, format)                                                                                \
    static void name(const float *x, int64_t blocks, const uint8_t *data, const float *scales, float *out) { \
        row_group(format, x, blocks, data, scales, out);                                                      \
    }
ROW_GROUP(row_group_q4_1, FORMAT_Q4_1)
ROW_GROUP(row_group_q8_0, FORMAT_Q8_0)
ROW_GROUP(row_group_bf16, FORMAT_BF16)
ROW_GROUP(row_group_q4_0, FORMAT_Q4_0)
ROW_GROUP(row_group_q5_0, FORMAT_Q5_0)
ROW_GROUP(row_group_q5_1, FORMAT_Q5_1)
ROW_GROUP(row_group_q6_k, FORMAT_Q6_K)
#undef ROW_GROUP

static const row_group_fn ROW_GROUPS[FORMATS] = {
    [FORMAT_Q4_1] = row_group_q4_1, [FORMAT_Q8_0] = row_group_q8_0, [FORMAT_BF16] = row_group_bf16,
    [FORMAT_Q4_0] = row_group_q4_0, [FORMAT_Q5_0] = row_group_q5_0, [FORMAT_Q5_1] = row_group_q5_1,
    [FORMAT_Q6_K] = row_group_q6_k,
};

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

/* The few-row kernels of the nibble and byte formats; packed_rows_bits.c has
 * those with bit planes. */
ROWS_OF(rows_q4_1, FORMAT_Q4_1)
ROWS_OF(rows_q8_0, FORMAT_Q8_0)
ROWS_OF(rows_q4_0, FORMAT_Q4_0)

static const rows_fn ROWS[FORMATS] = {
    [FORMAT_Q4_1] = rows_q4_1, [FORMAT_Q8_0] = rows_q8_0, [FORMAT_Q4_0] = rows_q4_0,
    [FORMAT_Q5_0] = rows_q5_0, [FORMAT_Q5_1] = rows_q5_1, [FORMAT_Q6_K] = rows_q6_k,
};

/* The M rows' sums over strips [c, count) of one block, 8-wide: at most six
 * rows a call (four, then the rest, past six) and S strips a call (four at
 * two rows, else two), as the accumulators fit the 16 registers. */
static void strips_rows(rows_fn run, int M, int c, int count, const float *x, int64_t K, const uint8_t *data,
                        const float *scales, int64_t block_bytes, int64_t block_scales, float *acc) {
    const int lead = M <= 6 ? M : 4; /* rows of the first call */
    for (int r0 = 0; r0 < M; r0 = r0 == 0 ? lead : M) {
        const int R = r0 == 0 ? lead : M - lead;
        const int widest = R == 2 ? 4 : 2;
        for (int s = c; s < count; s += widest) {
            const int S = count - s < widest ? count - s : widest;
            run(R, S, x + r0 * K, K, data + s * block_bytes, scales + s * block_scales,
                acc + r0 * COLS + s * LANES);
        }
    }
}

/* out [M, N] (row stride ldo) for 2 <= M <= REGISTER_ROWS over this thread's strips [first,
 * last): per group, its strips of each block in turn, S at a time (the
 * rows' doc above). With AVX-512, Q4_1 and Q8_0 take the strips two at a
 * time in 16-wide registers, and an odd strip left the 8-wide code. */
void packed_few_rows(int format, const float *x, int64_t M, int64_t K, int64_t blocks,
                     const uint8_t *data, const float *scales, int64_t block_bytes,
                     int64_t block_scales, int64_t N, int64_t first, int64_t last, float *out,
                     int64_t ldo) {
    float acc[REGISTER_ROWS * COLS];
    const rows_fn run = ROWS[format];
#ifdef METRALE_AVX512
    const int pairs_path = has_rows_pairs(format), widest_pairs = M <= 3 ? 4 : 2;
#endif
    for (int64_t s0 = first, s1; s0 < last; s0 = s1) {
        const int64_t group = s0 / GROUP, group_end = (group + 1) * GROUP;
        s1 = last < group_end ? last : group_end;
        const int count = (int)(s1 - s0);
        memset(acc, 0, sizeof(float) * (size_t)M * COLS);
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t at = (group * blocks + b) * GROUP + s0 % GROUP;
            const uint8_t *bytes = data + at * block_bytes;
            const float *sc = scales + at * block_scales;
            int c = 0;
#ifdef METRALE_AVX512
            for (int pairs; pairs_path && (pairs = (count - c) / 2) > 0; c += 2 * pairs) {
                pairs = pairs < widest_pairs ? pairs : widest_pairs;
                run_rows_pairs(format, (int)M, pairs, x + b * BLOCK, K, bytes + c * block_bytes,
                               sc + c * block_scales, acc + c * LANES);
            }
#endif
            strips_rows(run, (int)M, c, count, x + b * BLOCK, K, bytes, sc, block_bytes, block_scales, acc);
        }
        const int64_t n0 = s0 * LANES, width = N - n0 < count * LANES ? N - n0 : count * LANES;
        for (int64_t m = 0; m < M; m++) memcpy(out + m * ldo + n0, acc + m * COLS, sizeof(float) * width);
    }
}

/* One row over this thread's strips [first, last) (packed.h): the group
 * product of the format, by strip pairs where AVX-512 has them. */
void packed_one_row(int format, const float *x, int64_t blocks, const uint8_t *data, const float *scales,
                    int64_t block_bytes, int64_t block_scales, int64_t N, int64_t first, int64_t last,
                    float *out) {
    row_group_fn group_product = ROW_GROUPS[format];
#ifdef METRALE_AVX512
    const row_group_fn pairs = row_group_pairs(format);
    if (pairs != NULL) group_product = pairs;
#endif
    row_product(group_product, x, blocks, data, scales, block_bytes, block_scales, N, first, last, out);
}
#endif
