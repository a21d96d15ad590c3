/*
 * Linear layers over packed weights, computed in float32.
 *
 * Contract: out[m][n] = sum_k x[m][k] * w[n][k] for x [M, K] float32 and a
 * weight [N, K] kept packed (GGUF blocks of 32 along K: Q4_0, Q4_1, Q5_0,
 * Q5_1, Q8_0, and the K-quants as those or as Q6_K's own; or bfloat16) in
 * the layout below. A weight value is decoded with exactly the arithmetic
 * gguf's reference dequantizer uses (packed_columns.h states each format's),
 * so the float32 weight this file computes with is bit-for-bit the one
 * `metrale` writes to model.safetensors: the model is the same, only fewer
 * bytes cross the memory bus.
 *
 * Layout (metrale/engine/runtime/packed.py writes it): the weight's rows are
 * taken 64 at a time (a group; the last one padded with zero rows), a group's
 * 8 strips of 8 rows each; within a strip, each block of 32 columns is stored
 * byte plane by byte plane (packed_columns.h), so that one 8-wide load
 * decodes column k of eight rows: e.g.
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
 * Files: this one holds the entry points (metrale_packed_linear, which
 * splits the strips among threads and picks a path by the row count, and
 * metrale_decode) and the decoders of a block into a buffer; packed_columns.h
 * the formats' arithmetic, column by column; packed_tiles.c the tiles over a
 * decoded chunk; packed_rows.c the register paths (one row, and two to
 * REGISTER_ROWS), packed_rows512.c their 16-wide forms for Q4_1, Q8_0 and
 * one-row bfloat16 (the other formats take the 8-wide register paths in
 * every build, and the 16-wide tiles); packed.h the layout's sizes they
 * share.
 *
 * Built on first use by metrale/engine/kernels/binding.py with the system C
 * compiler (-O3 -march=native -fopenmp -ffp-contract=off: no fused
 * multiply-add may merge the two roundings of the Q4_1 decode). OpenMP
 * resolves to the runtime torch has already loaded, so both share one
 * thread pool.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "packed_columns.h"

/* Decodes one block of `count` consecutive strips: out[k * ld + 8 s + n] =
 * w[8 s + n][k] for k < 32, n < 8, s < count. `data` and `scales` point at
 * the first strip's block bytes and scales (the strips' follow on). One call
 * per block and group, not per strip: the calls cost more than the loop. */
typedef void (*decode_block_fn)(const uint8_t *data, const float *scales, int count, float *out, int64_t ld);

/* A decoder of one format: packed_columns.h's arithmetic, column by column. */
static inline __attribute__((always_inline)) void decode_strips(
    const int format, const uint8_t *data, const float *scales, int count, float *out, int64_t ld) {
    const int64_t bytes = strip_block_bytes(format), block_scales = strip_block_scales(format);
    for (int strip = 0; strip < count; strip++, data += bytes, scales += block_scales, out += LANES) {
#ifdef METRALE_AVX2
        EACH_COLUMN(_mm256_storeu_ps(out + (16 * high + LANES * jb + s) * ld,
                                     column8(format, data, scales, high, jb, s));)
#else
        for (int k = 0; k < BLOCK; k++)
            for (int n = 0; n < LANES; n++) out[k * ld + n] = value1(format, data, scales, n, k);
#endif
    }
}

#define DECODER(name, format)                                                                         \
    static void name(const uint8_t *data, const float *scales, int count, float *out, int64_t ld) { \
        decode_strips(format, data, scales, count, out, ld);                                         \
    }
DECODER(decode_q4_1, FORMAT_Q4_1)
DECODER(decode_q8_0, FORMAT_Q8_0)
DECODER(decode_bf16, FORMAT_BF16)
DECODER(decode_q4_0, FORMAT_Q4_0)
DECODER(decode_q5_0, FORMAT_Q5_0)
DECODER(decode_q5_1, FORMAT_Q5_1)
DECODER(decode_q6_k, FORMAT_Q6_K)
#undef DECODER

/* The decoder of `format` and the size of one strip block: its bytes and
 * its scales. NULL for an unknown format. */
static decode_block_fn decoder(int format, int64_t *block_bytes, int64_t *block_scales) {
    static const decode_block_fn decoders[FORMATS] = {
        [FORMAT_Q4_1] = decode_q4_1, [FORMAT_Q8_0] = decode_q8_0, [FORMAT_BF16] = decode_bf16,
        [FORMAT_Q4_0] = decode_q4_0, [FORMAT_Q5_0] = decode_q5_0, [FORMAT_Q5_1] = decode_q5_1,
        [FORMAT_Q6_K] = decode_q6_k,
    };
    if (format < 0 || format >= FORMATS) return NULL;
    *block_bytes = strip_block_bytes(format);
    *block_scales = strip_block_scales(format);
    return decoders[format];
}

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

/* out [M, N] (row stride ldo) = x [M, K] @ decode(weight)^T for a weight of
 * one format. Returns 0, -1 for a bad format or a K that is not a multiple
 * of 32, or -2 when out of memory. */
static int linear_one_format(
    int format, const float *x, int64_t M, int64_t K, const uint8_t *data, const float *scales,
    int64_t N, float *out, int64_t ldo, int threads) {
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
            packed_one_row(format, x, blocks, data, scales, block_bytes, block_scales, N, first, last, out);
            first = last; /* nothing left for the tiles */
        } else if (M <= REGISTER_ROWS && format != FORMAT_BF16) {
            packed_few_rows(format, x, M, K, blocks, data, scales, block_bytes, block_scales, N, first, last, out,
                            ldo);
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
                packed_tiles(x + b0 * BLOCK, M, K, buf, chunk * BLOCK, count, acc);
            }
            const int64_t n0 = s0 * LANES, width = N - n0 < count * LANES ? N - n0 : count * LANES;
            for (int64_t m = 0; m < M; m++) memcpy(out + m * ldo + n0, acc + m * COLS, sizeof(float) * width);
        }
        free(buf);
        free(acc);
    }
    return failed ? -2 : 0;
}

/* A weight stacked from parts of different formats (q/k/v of a GGUF whose
 * v is stored in another type): `data` points at its parts' rows of
 * PART_FIELDS int64 (format, data, scales, rows), rows in order, their rows
 * summing to N. Each part is its own product into its columns of out. */
enum { PART_FORMAT, PART_DATA, PART_SCALES, PART_ROWS, PART_FIELDS };

/* out [M, N] = x [M, K] @ decode(weight)^T. Returns 0, or -1 for a bad
 * format or a K that is not a multiple of 32, or -2 when out of memory. */
int metrale_packed_linear(
    int format, const float *x, int64_t M, int64_t K, const uint8_t *data, const float *scales,
    int64_t N, float *out, int threads) {
    if (format != FORMAT_PARTS) return linear_one_format(format, x, M, K, data, scales, N, out, N, threads);
    const int64_t *part = (const int64_t *)data;
    for (int64_t n0 = 0; n0 < N; n0 += part[PART_ROWS], part += PART_FIELDS) {
        if (part[PART_FORMAT] == FORMAT_PARTS || part[PART_ROWS] <= 0 || n0 + part[PART_ROWS] > N) return -1;
        const int code = linear_one_format(
            (int)part[PART_FORMAT], x, M, K, (const uint8_t *)(intptr_t)part[PART_DATA],
            (const float *)(intptr_t)part[PART_SCALES], part[PART_ROWS], out + n0, N, threads);
        if (code != 0) return code;
    }
    (void)scales;
    return 0;
}

/* out [N, K] = decode(weight) in row-major order: for training (the frozen
 * LM head) and for tests. */
int metrale_decode(int format, int64_t K, const uint8_t *data, const float *scales, int64_t N, float *out, int threads) {
    if (format == FORMAT_PARTS) { /* each part's rows in turn */
        const int64_t *part = (const int64_t *)data;
        for (int64_t n0 = 0; n0 < N; n0 += part[PART_ROWS], part += PART_FIELDS) {
            if (part[PART_FORMAT] == FORMAT_PARTS || part[PART_ROWS] <= 0 || n0 + part[PART_ROWS] > N) return -1;
            const int code = metrale_decode((int)part[PART_FORMAT], K, (const uint8_t *)(intptr_t)part[PART_DATA],
                                            (const float *)(intptr_t)part[PART_SCALES], part[PART_ROWS],
                                            out + n0 * K, threads);
            if (code != 0) return code;
        }
        return 0;
    }
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
