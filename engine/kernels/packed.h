/*
 * What the files of the packed-weight product share: the sizes of the
 * weight layout and of a tile, the vector paths the compiler targets, and
 * each path's entry point. packed_linear.c states the contract, the layout
 * and why; binding.py hashes this file with the sources, so a change here
 * rebuilds the library.
 */
#ifndef METRALE_PACKED_H
#define METRALE_PACKED_H
#include <stdint.h>

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

/* The formats of a strip block (packed_columns.h): binding.py's FORMATS. */
enum {
    FORMAT_Q4_1 = 0, FORMAT_Q8_0 = 1, FORMAT_BF16 = 2, FORMAT_Q4_0 = 3, FORMAT_Q5_0 = 4,
    FORMAT_Q5_1 = 5, FORMAT_Q6_K = 6, FORMATS = 7,
    FORMAT_PARTS = 7, /* not a block format: parts of others, stacked (packed_linear.c) */
};
enum {
    LANES = 8,        /* rows of a strip: one 8-wide vector */
    BLOCK = 32,       /* columns of a quantization block */
    GROUP = 8,        /* strips decoded together: 64 outputs */
    COLS = GROUP * LANES,
    CHUNK_BLOCKS = 2, /* blocks decoded at a time: 64 columns, 16 KB of floats */
    TILE_ROWS = 6,
};

/* The paths below are the library's own: not exported from it. */
#define PACKED_INTERNAL __attribute__((visibility("hidden")))

/* packed_tiles.c: acc [M][COLS] += x[:, chunk] @ w, w the decoded chunk
 * [kc][COLS] of `strips` strips, x [M, K] from the chunk's first column. */
PACKED_INTERNAL void packed_tiles(const float *x, int64_t M, int64_t K, const float *w, int kc, int strips,
                                  float *acc);

#ifdef METRALE_AVX2
/* packed_rows.c, the register paths, over this thread's strips [first,
 * last) of a weight of `blocks` blocks a row (strip blocks of `block_bytes`
 * bytes and `block_scales` scales): out [N] = x [K] @ decode(weight)^T for
 * one row, and out [M, N] (row stride ldo) for 2 <= M <= REGISTER_ROWS
 * rows of any format but bfloat16. */
PACKED_INTERNAL void packed_one_row(int format, const float *x, int64_t blocks, const uint8_t *data,
                                    const float *scales, int64_t block_bytes, int64_t block_scales, int64_t N,
                                    int64_t first, int64_t last, float *out);
PACKED_INTERNAL void packed_few_rows(int format, const float *x, int64_t M, int64_t K, int64_t blocks,
                                     const uint8_t *data, const float *scales, int64_t block_bytes,
                                     int64_t block_scales, int64_t N, int64_t first, int64_t last, float *out,
                                     int64_t ldo);

/* A group's 64 outputs for one row: `data` and `scales` at its first block. */
typedef void (*row_group_fn)(const float *x, int64_t blocks, const uint8_t *data, const float *scales, float *out);
#endif

#ifdef METRALE_AVX512
/* packed_rows512.c, the 16-wide register paths of Q4_1, Q8_0 and (one row)
 * bfloat16: the one-row group product of `format` by strip pairs, NULL for
 * a format without one; and R rows x D strip pairs of one Q4_1 or Q8_0
 * block, accumulated into acc [R][COLS] (packed_rows.c states the walk). */
PACKED_INTERNAL row_group_fn row_group_pairs(int format);
PACKED_INTERNAL int has_rows_pairs(int format);
PACKED_INTERNAL void run_rows_pairs(int format, int R, int D, const float *x, int64_t K, const uint8_t *bytes,
                                    const float *sc, float *acc);
#endif
#endif
