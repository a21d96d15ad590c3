/*
 * One column of a strip block decoded: the formats' block sizes and their
 * arithmetic, in one place for the decoders into a buffer (packed_linear.c)
 * and the register paths (packed_rows.c), so both give the same floats.
 *
 * A strip block is 8 rows x 32 columns of one format, its bytes stored as
 * planes of 8 (plane p holds byte p of each row's block, row n at 8 p + n)
 * and its scales likewise (scale i of row n at 8 i + n). Per row's block:
 *   Q8_0: 32 signed bytes q;                    scale d:      d * q
 *   Q4_1: 16 bytes of nibbles;                  scales d, m:  d * q + m
 *   Q4_0: 16 bytes of nibbles;                  scale d:      d * (q - 8)
 *   Q5_1: nibbles, then 4 bytes of fifth bits;  scales d, m:  d * q + m
 *   Q5_0: nibbles, then 4 bytes of fifth bits;  scale d:      d * (q - 16)
 *   Q6_K: nibbles, then 8 bytes of 2-bit highs; scales d0, d1 (columns
 *         0-15, 16-31):                                       d * (q - 32)
 *   bf16: 32 16-bit values (2 planes each);     none:         a shift.
 * Nibble byte j holds column j (low) and j + 16 (high), as GGUF orders a
 * 32-value block; fifth-bit byte i holds columns 8 i .. 8 i + 7 (bit
 * k % 8), 2-bit byte i columns 4 i .. 4 i + 3 (bits 2 (k % 4)). q is the
 * unsigned value of those bits; the offset is taken in integers, so the one
 * float rounding of d * (q - z) is gguf's (a product of at most 24
 * significant bits: exact), and d * q + m rounds twice as gguf's numpy code
 * does. The K-quants are held in these layouts (binding.py's converter says
 * how): Q4_K and Q5_K blocks of 32 as Q4_1 and Q5_1 with d = super-block d
 * times the 6-bit scale and m = -(dmin times the 6-bit min), which gguf's
 * d * q - dm rounds identically; Q6_K keeps its 16-value scales.
 *
 * Contract: column8 (AVX2) and value1 (portable) give the same bits for
 * every format; the compiler folds the switch away when `format` is a
 * constant, as in every caller.
 */
#ifndef METRALE_PACKED_COLUMNS_H
#define METRALE_PACKED_COLUMNS_H
#include <stdint.h>
#include <string.h>

#include "packed.h"

/* Bytes of one strip block of `format` (8 rows x 32 columns); -1 if unknown. */
static inline __attribute__((always_inline)) int64_t strip_block_bytes(const int format) {
    switch (format) {
    case FORMAT_Q8_0: return LANES * BLOCK;
    case FORMAT_Q4_1: case FORMAT_Q4_0: return LANES * BLOCK / 2;
    case FORMAT_Q5_1: case FORMAT_Q5_0: return LANES * (BLOCK / 2 + BLOCK / 8);
    case FORMAT_Q6_K: return LANES * (BLOCK / 2 + BLOCK / 4);
    case FORMAT_BF16: return 2 * LANES * BLOCK;
    default: return -1;
    }
}

/* Scales of one strip block of `format`. */
static inline __attribute__((always_inline)) int64_t strip_block_scales(const int format) {
    switch (format) {
    case FORMAT_Q8_0: case FORMAT_Q4_0: case FORMAT_Q5_0: return LANES;
    case FORMAT_Q4_1: case FORMAT_Q5_1: case FORMAT_Q6_K: return 2 * LANES;
    default: return 0;
    }
}

/* Whether `format` takes d * q + m (two roundings) rather than d * (q - z). */
static inline __attribute__((always_inline)) int is_affine(const int format) {
    return format == FORMAT_Q4_1 || format == FORMAT_Q5_1;
}

/* The integer subtracted from q before the product (0 for the affine ones). */
static inline __attribute__((always_inline)) int zero_point(const int format) {
    return format == FORMAT_Q4_0 ? 8 : format == FORMAT_Q5_0 ? 16 : format == FORMAT_Q6_K ? 32 : 0;
}

/* Row n's weight at column k of a strip block, in portable C. */
static inline float value1(const int format, const uint8_t *bytes, const float *sc, int n, int k) {
    if (format == FORMAT_BF16) {
        uint16_t half;
        memcpy(&half, bytes + 2 * (LANES * k + n), sizeof half);
        const uint32_t bits = (uint32_t)half << 16;
        float out;
        memcpy(&out, &bits, sizeof out);
        return out;
    }
    if (format == FORMAT_Q8_0) return (float)(int8_t)bytes[LANES * k + n] * sc[n];
    int q = bytes[LANES * (k & 15) + n];
    q = k & 16 ? q >> 4 : q & 0x0F;
    if (format == FORMAT_Q5_0 || format == FORMAT_Q5_1)
        q |= (bytes[LANES * (16 + k / 8) + n] >> (k % 8) & 1) << 4;
    if (format == FORMAT_Q6_K) q |= (bytes[LANES * (16 + k / 4) + n] >> (2 * (k % 4)) & 3) << 4;
    const float d = sc[(format == FORMAT_Q6_K && k >= 16 ? LANES : 0) + n];
    if (is_affine(format)) return (float)q * d + sc[LANES + n];
    return (float)(q - zero_point(format)) * d;
}

#ifdef METRALE_AVX2
/* `bits` shifted so that its bit `from` lands at bit `to`, the rest masked
 * by `mask` (the shift is a constant where k is). */
static inline __attribute__((always_inline)) __m256i move_bits(__m256i bits, int from, int to, int mask) {
    bits = from > to ? _mm256_srli_epi32(bits, from - to) : _mm256_slli_epi32(bits, to - from);
    return _mm256_and_si256(bits, _mm256_set1_epi32(mask));
}

/* Plane p of a strip block: byte p of each of the 8 rows, widened. */
static inline __attribute__((always_inline)) __m256i plane(const uint8_t *bytes, int p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(bytes + LANES * p)));
}

/* Column k = 16 high + 8 jb + s of the 8 rows of a strip block, as value1
 * gives each. Callers pass `high` and `s` as constants (EACH_COLUMN), which
 * makes every bit shift an immediate; jb only moves addresses. */
static inline __attribute__((always_inline)) __m256 column8(
    const int format, const uint8_t *bytes, const float *sc, const int high, const int jb, const int s) {
    const int k = 16 * high + LANES * jb + s;
    if (format == FORMAT_BF16) {
        const __m128i halves = _mm_loadu_si128((const __m128i *)(bytes + 2 * LANES * k));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
    }
    if (format == FORMAT_Q8_0) {
        const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(bytes + LANES * k)));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_loadu_ps(sc));
    }
    __m256i q = plane(bytes, LANES * jb + s);
    q = high ? _mm256_srli_epi32(q, 4) : _mm256_and_si256(q, _mm256_set1_epi32(0x0F));
    if (format == FORMAT_Q5_0 || format == FORMAT_Q5_1)
        q = _mm256_or_si256(q, move_bits(plane(bytes, 16 + 2 * high + jb), s, 4, 0x10));
    if (format == FORMAT_Q6_K)
        q = _mm256_or_si256(q, move_bits(plane(bytes, 16 + k / 4), 2 * (s % 4), 4, 0x30));
    const __m256 d = _mm256_loadu_ps(sc + (format == FORMAT_Q6_K ? LANES * high : 0));
    if (is_affine(format)) return _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), d), _mm256_loadu_ps(sc + LANES));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(zero_point(format)))), d);
}

/* `step` for every column of a block in ascending order, with `high`, `jb`
 * and `s` in scope (k = 16 high + 8 jb + s): `high` and `s` constants, so
 * column8's shifts are immediates, in two copies of a loop over jb. */
#define EACH_COLUMN(step)                                                        \
    for (int jb = 0; jb < 2; jb++) {                                             \
        _Pragma("GCC unroll 8") for (int s = 0; s < LANES; s++) {                \
            const int high = 0;                                                  \
            step                                                                 \
        }                                                                        \
    }                                                                            \
    for (int jb = 0; jb < 2; jb++) {                                             \
        _Pragma("GCC unroll 8") for (int s = 0; s < LANES; s++) {                \
            const int high = 1;                                                  \
            step                                                                 \
        }                                                                        \
    }
#endif
#endif
