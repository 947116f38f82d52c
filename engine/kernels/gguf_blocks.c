/*
 * Products by GGUF weights computed as stored: y = x W^T where W is in llama.cpp's Q8_0, Q4_0
 * or Q4_1 blocks of 32 weights, or Q4_K, Q5_K or Q6_K super-blocks of 256, read in place
 * from the file's memory map.
 *
 * twostroke.engine.kernels.gguf_blocks compiles this file at run time (build.py) and says
 * why and what was measured. The formats (gguf's constants and quants.py; written here from
 * them):
 *
 *   Q8_0  34 bytes: d (float16), q[32] (int8)                     w[i] = d q[i]
 *   Q4_0  18 bytes: d (float16), n[16] (two 4-bit values a byte)  w[i] = d (nib(i) - 8)
 *   Q4_1  20 bytes: d, m (float16), n[16]                         w[i] = d nib(i) + m
 *   Q5_0  22 bytes: d, h (32 bits, little-endian), n[16]     w[i] = d (nib(i) + 16 h_i - 16)
 *   Q5_1  24 bytes: d, m, h, n[16]                           w[i] = d (nib(i) + 16 h_i) + m
 *
 * where nib(i) is the low half of n[i] for i < 16 and the high half of n[i - 16] after, and
 * h_i bit i of h.
 *
 * And the "K" super-blocks of 256 weights, eight sub-blocks of 32 (Q6_K: sixteen of 16):
 *
 *   Q4_K  144 bytes: d, dmin (float16), s[12] (eight 6-bit scales sc_j and mins m_j
 *         packed), n[128]                            w = d sc_j nib - dmin m_j
 *   Q5_K  176 bytes: d, dmin, s[12], h[32] (the fifth bits), n[128]
 *                                                    w = d sc_j (nib + 16 bit) - dmin m_j
 *   Q6_K  210 bytes: l[128] (low 4 bits), h[64] (high 2 bits), sc[16] (int8), d (float16)
 *                                                    w = d sc_{i/16} (low + 16 high - 32)
 *
 * Sub-block j of Q4_K/Q5_K takes the low (j even) or high (j odd) halves of n[32 (j/2) ..],
 * Q5_K's bit j of h[0..31]; sc_j, m_j are the low 6 bits of s[j], s[j + 4] for j < 4, else
 * s[j + 4]'s low (sc) and high (m) halves with the top two bits of s[j - 4] (sc) and s[j]
 * (m) above them. Q6_K's weight 128 h + 32 c + t (h < 2, c < 4, t < 32) takes the low
 * (c < 2) or high half of l[64 h + 32 (c % 2) + t] and bits 2c, 2c + 1 of h[32 h + t].
 *
 * The activations are quantized first, per row and per block of 32, as llama.cpp does
 * (twostroke_quantize_rows): a scale s = max|x| / 127 and q = x / s rounded to the nearest
 * integer (ties to even), and the block's sum s * sum(q) for the terms that do not depend on
 * the weight's index (Q4_0's -8, Q4_1's m). A block so small that 1 / s overflows (max|x|
 * under 127 / FLT_MAX, about 3.7e-37) quantizes to zeros with s = 0: llama.cpp converts the
 * infinite quotients to integers there, which C leaves undefined. A block's product is then an integer dot product
 * of 32 8-bit pairs times two scales:
 *
 *   Q8_0: d s sum(q_w q_x)     Q4_0: d s sum(nib q_x) - 8 d (s sum q_x)
 *   Q4_1: d s sum(nib q_x) + m (s sum q_x)   (Q5_0, Q5_1 likewise, nib + 16 h_i, -16 d)
 *
 * AVX2 multiplies the unsigned nibbles (or |q_w|) by the signed activations pairwise into
 * 16 bits (VPMADDUBSW: 15 * 127 * 2 or 128 * 127 * 2 fit) and adds pairs into 32 bits
 * (VPMADDWD); without AVX2 the same sums are computed in portable C.
 *
 * The K types use the same activations, quantized per 32, not per 256 as llama.cpp's Q8_K:
 * a K sub-block is 32 weights (or two halves of 16), so each sub-block's product is one
 * integer dot product times d s and its integer scale, as for the 32-blocks; one quantized
 * row serves the parts of a fused projection whatever their types (a Q4_K_M file mixes
 * Q4_K and Q6_K in one q/k/v), and a scale per 32 rounds the activations no worse than one
 * per 256. The price is a float multiply-add per 32 weights where Q8_K pays one per 256.
 * VPMADDWD multiplies the pair sums by the sub-block's scale instead of 1: Q5_K's 31 * 127
 * * 2 by 63 (Q6_K: |q| <= 32 by |sc| <= 128, times two) stays far inside 32 bits, and a
 * block's eight lanes sum to under 2^24, exact in float32. The mins enter as dmin m_j (d
 * s sum q_x) per sub-block, eight at once from the activation blocks' sums. Which one a library has
 * is decided by its compile flags, which the CPU's personality sets (twostroke.gpu.isa), so
 * it is chosen once, when the library is built or loaded.
 *
 * twostroke_block_linear_float() multiplies by the activations themselves instead, each
 * weight block dequantized in registers (float_tile(), below): the file's own model, as its
 * float32 dequantization computes it.
 *
 * Shapes: the thread team (torch's OpenMP team) splits the output columns, each thread a
 * contiguous range of weight rows, read from memory once a call; each weight block is
 * unpacked once per tile of TILE activation rows (one row for a decode step, TILE for a
 * batch or a prefill), while the row's weights stay in the first-level cache for the next
 * tile.
 */
#include <float.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define BLOCKS_AVX2 1
#else
#define BLOCKS_AVX2 0
#endif
#if BLOCKS_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define BLOCKS_AVX512 1
#else
#define BLOCKS_AVX512 0
#endif
#if BLOCKS_AVX512 && defined(__AVX512VNNI__)
#define BLOCKS_VNNI 1
#else
#define BLOCKS_VNNI 0
#endif

/* GGML's type numbers (gguf.GGMLQuantizationType). */
#define TYPE_Q4_0 2
#define TYPE_Q4_1 3
#define TYPE_Q5_0 6
#define TYPE_Q5_1 7
#define TYPE_Q8_0 8
#define TYPE_Q4_K 12
#define TYPE_Q5_K 13
#define TYPE_Q6_K 14

#define BLOCK 32 /* weights a block (an activation block, a sub-block of the K types) */
#define SUPER 256 /* weights a K super-block */
#define TILE 4   /* activation rows a weight block is unpacked for */
#define WROWS 4  /* weight rows a tile takes at most */

/* Multiply-adds below which one thread does the whole call (projection_bf16.c's rule). */
#define PARALLEL_WORK (1 << 18)

/* The path this library computes with: 0 portable C, 1 AVX2, 2 AVX-512, 3 AVX-512 VNNI. */
int twostroke_blocks_path(void) { return BLOCKS_AVX2 + BLOCKS_AVX512 + BLOCKS_VNNI; }

static ptrdiff_t block_bytes(int type) {
    switch (type) {
    case TYPE_Q8_0: return 2 + BLOCK;
    case TYPE_Q4_0: return 2 + BLOCK / 2;
    case TYPE_Q4_1: return 4 + BLOCK / 2;
    case TYPE_Q5_0: return 6 + BLOCK / 2;
    case TYPE_Q5_1: return 8 + BLOCK / 2;
    case TYPE_Q4_K: return 4 + 12 + SUPER / 2;
    case TYPE_Q5_K: return 4 + 12 + SUPER / 8 + SUPER / 2;
    case TYPE_Q6_K: return SUPER / 2 + SUPER / 4 + SUPER / 16 + 2;
    default: return 0;
    }
}

static int is_super(int type) { return type == TYPE_Q4_K || type == TYPE_Q5_K || type == TYPE_Q6_K; }

/* A 32-block with a min (Q4_1, Q5_1), with fifth bits (Q5_0, Q5_1); where its nibbles start;
 * the offset (times d) of one without a min: Q4_0's -8, Q5_0's -16. */
static int has_min(int type) { return type == TYPE_Q4_1 || type == TYPE_Q5_1; }
static int has_fifth(int type) { return type == TYPE_Q5_0 || type == TYPE_Q5_1; }
static ptrdiff_t nibbles_at(int type) { return 2 + 2 * has_min(type) + 4 * has_fifth(type); }
static float offset_of(int type) { return type == TYPE_Q5_0 ? -16.0f : -8.0f; }

/* Weights a block of `type` holds. */
static ptrdiff_t block_weights(int type) { return is_super(type) ? SUPER : BLOCK; }

/* Where a product's tiles sum (EXACT_SUMS_BEGIN to _END), no reassociation or contraction
 * (the rest of the library keeps the common fast-math flags): a row's sums must not depend
 * on the tile of rows it falls in (4 weight rows by 1 or 2 rows, 2 by 3 or 4), each of which
 * the compiler would vectorize and fuse its own way, so that a row among others summed
 * otherwise than alone and greedy answers changed with the traffic (docs/models.md, "One
 * answer per request"). The vector paths' intrinsics are what they say either way; the
 * portable C's sums and the float activations' (GCC's vector types) are held by this. The
 * activations' quantization between (quantize_row) keeps the fast flags: its maximum and
 * its integer sum are exact in any order. */
#if defined(__clang__)
#define EXACT_SUMS_BEGIN _Pragma("clang fp reassociate(off)") _Pragma("clang fp contract(off)")
#define EXACT_SUMS_END _Pragma("clang fp reassociate(on)") _Pragma("clang fp contract(fast)")
#elif defined(__GNUC__)
#define EXACT_SUMS_BEGIN                                                                           \
    _Pragma("GCC push_options") _Pragma("GCC optimize(\"no-associative-math\", \"fp-contract=off\")")
#define EXACT_SUMS_END _Pragma("GCC pop_options")
#else
#define EXACT_SUMS_BEGIN
#define EXACT_SUMS_END
#endif
/* The integer products' tiles: their portable C's float sums need it; AVX2's and
 * AVX-512's intrinsics sum alike in every tile without it, and keep the fast flags (one
 * stream of SmolLM2's Q4_1 file: 16.7 ms a token with them, about 5 % more without). */
#if BLOCKS_AVX2
#define BLOCK_SUMS_BEGIN
#define BLOCK_SUMS_END
#else
#define BLOCK_SUMS_BEGIN EXACT_SUMS_BEGIN
#define BLOCK_SUMS_END EXACT_SUMS_END
#endif
BLOCK_SUMS_BEGIN

/* IEEE half to float, exact (subnormals included), in portable C. */
static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu,
             mantissa = h & 0x3ffu, bits;
    if (exponent == 0x1fu) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else if (mantissa) { /* subnormal: normalize */
        exponent = 113u;
        while (!(mantissa & 0x400u)) {
            mantissa <<= 1;
            exponent--;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* Q4_K/Q5_K's 6-bit scale and min of sub-block j (< 8), from the 12 packed bytes `s`. */
static inline void scale_min(const uint8_t *s, int j, int *scale, int *min) {
    if (j < 4) {
        *scale = s[j] & 63;
        *min = s[j + 4] & 63;
    } else {
        *scale = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/*
 * Sub-block j (< 8) of a K super-block: its 32 integer weights (Q4_K 0..15, Q5_K 0..31,
 * Q6_K -32..31), the integer scales of its two halves of 16 (equal but for Q6_K's) and its
 * min (0 for Q6_K): w[t] = d scale[t / 16] out[t] - dmin min.
 */
static inline void sub_block(int type, const uint8_t *block, int j, int8_t out[BLOCK],
                             int scale[2], int *min) {
    if (type == TYPE_Q6_K) {
        int c = j % 4, shift = 4 * (c / 2);
        const uint8_t *low = block + 64 * (j / 4) + 32 * (c % 2), *high = block + 128 + 32 * (j / 4);
        for (int t = 0; t < BLOCK; t++)
            out[t] = (int8_t)((((low[t] >> shift) & 15) | (((high[t] >> (2 * c)) & 3) << 4)) - 32);
        const int8_t *scales = (const int8_t *)(block + 192);
        scale[0] = scales[2 * j];
        scale[1] = scales[2 * j + 1];
        *min = 0;
        return;
    }
    const uint8_t *nibbles = block + (type == TYPE_Q5_K ? 48 : 16) + 32 * (j / 2);
    int shift = 4 * (j % 2);
    for (int t = 0; t < BLOCK; t++) {
        int value = (nibbles[t] >> shift) & 15;
        if (type == TYPE_Q5_K)
            value |= ((block[16 + t] >> j) & 1) << 4;
        out[t] = (int8_t)value;
    }
    scale_min(block + 4, j, &scale[0], min);
    scale[1] = scale[0];
}

BLOCK_SUMS_END

/* Row r of x quantized per block (see the top of the file) into q, scales and sums. */
static void quantize_row(const float *x, ptrdiff_t x_stride, ptrdiff_t r, ptrdiff_t in_features,
                         int8_t *q, float *scales, float *sums) {
    ptrdiff_t blocks = in_features / BLOCK;
    for (ptrdiff_t b = 0; b < blocks; b++) {
        const float *v = x + r * x_stride + b * BLOCK;
        int8_t *out = q + r * in_features + b * BLOCK;
        float largest = 0.0f;
        for (int i = 0; i < BLOCK; i++) {
            float a = __builtin_fabsf(v[i]);
            largest = a > largest ? a : largest;
        }
        float scale = largest / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
        if (!(inverse <= FLT_MAX)) scale = inverse = 0.0f; /* see the top of the file */
        int total = 0;
        for (int i = 0; i < BLOCK; i++) {
            int value = (int)__builtin_rintf(v[i] * inverse);
            out[i] = (int8_t)value;
            total += value;
        }
        scales[r * blocks + b] = scale;
        sums[r * blocks + b] = scale * (float)total;
    }
}

/*
 * q[rows][in_features], scales and sums [rows][in_features / 32]: each row of x (row stride
 * x_stride) quantized per block (see above). in_features is a multiple of 32.
 */
void twostroke_quantize_rows(const float *x, ptrdiff_t x_stride, ptrdiff_t rows,
                             ptrdiff_t in_features, int8_t *q, float *scales, float *sums) {
#pragma omp parallel for if (rows * in_features >= PARALLEL_WORK / 8) schedule(static)
    for (ptrdiff_t r = 0; r < rows; r++)
        quantize_row(x, x_stride, r, in_features, q, scales, sums);
}

BLOCK_SUMS_BEGIN

#if BLOCKS_AVX512
/*
 * tile()'s blocks two at a time, in 512-bit vectors, for the 32-block types: blocks b and
 * b + 1 of a weight row side by side against 64 activation bytes, from block 0 while a pair
 * is left; adds each pair's sums into acc (8 lanes a row, as tile()'s AVX2 loop sums them)
 * and the offset terms into extra, and returns the first block it left (tile() takes the
 * last odd one). With VNNI one VPDPBUSD makes the sums of 4 products that VPMADDUBSW then
 * VPMADDWD by 1 make without it. Q8_0's signed weights are made unsigned by moving their
 * signs onto the activations (AVX-512 has no VPSIGNB: a masked subtraction from 0, where
 * |q_x| <= 127 cannot overflow).
 */
static inline __attribute__((always_inline)) ptrdiff_t pairs(
    int type, int wrows, int count, const uint8_t *w, ptrdiff_t row_bytes, ptrdiff_t blocks,
    const int8_t *q, ptrdiff_t in_features, const float *scales, const float *sums,
    __m256 acc[WROWS][TILE], float extra[WROWS][TILE]) {
    ptrdiff_t size = block_bytes(type), b = 0;
    __m512 wide[WROWS][TILE];
    __m128 offsets[WROWS][TILE]; /* lanes 0 and 1: the pair's offset terms */
    for (int k = 0; k < WROWS; k++)
        for (int r = 0; r < TILE; r++) {
            wide[k][r] = _mm512_setzero_ps();
            offsets[k][r] = _mm_setzero_ps();
        }
    /* Lanes 0-7 take element 0 of a pair's scales, 8-15 element 1. */
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i low = _mm512_set1_epi8(0x0f), zero = _mm512_setzero_si512();
#if !BLOCKS_VNNI
    const __m512i ones = _mm512_set1_epi16(1);
#endif
    for (; b + 1 < blocks; b += 2) {
        __m512i x[TILE];
        __m128 activation[TILE], total[TILE]; /* the two blocks' scales and sums */
        for (int r = 0; r < count; r++) {
            x[r] = _mm512_loadu_si512((const void *)(q + r * in_features + b * BLOCK));
            activation[r] = _mm_castpd_ps(_mm_load_sd((const double *)(scales + r * blocks + b)));
            total[r] = _mm_castpd_ps(_mm_load_sd((const double *)(sums + r * blocks + b)));
        }
        for (int k = 0; k < wrows; k++) {
            const uint8_t *first = w + k * row_bytes + b * size, *second = first + size;
            uint16_t h[2];
            memcpy(&h[0], first, 2);
            memcpy(&h[1], second, 2);
            __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128((int)(h[0] | (uint32_t)h[1] << 16)));
            __m128 coefficient = _mm_setzero_ps();
            __m512i weights;
            __mmask64 negative = 0;
            if (type == TYPE_Q8_0) {
                __m512i signs = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(first + 2))),
                    _mm256_loadu_si256((const __m256i *)(second + 2)), 1);
                weights = _mm512_abs_epi8(signs);
                negative = _mm512_movepi8_mask(signs);
            } else {
                __m128i one = _mm_loadu_si128((const __m128i *)(first + nibbles_at(type)));
                __m128i two = _mm_loadu_si128((const __m128i *)(second + nibbles_at(type)));
                weights = _mm512_and_si512(
                    _mm512_inserti64x4(
                        _mm512_castsi256_si512(_mm256_set_m128i(_mm_srli_epi16(one, 4), one)),
                        _mm256_set_m128i(_mm_srli_epi16(two, 4), two), 1),
                    low);
                if (has_fifth(type)) { /* byte i of 64 takes bit i of the two h: 16 if set */
                    uint32_t fifth[2];
                    memcpy(&fifth[0], first + nibbles_at(type) - 4, 4);
                    memcpy(&fifth[1], second + nibbles_at(type) - 4, 4);
                    __mmask64 set = (__mmask64)fifth[0] | (__mmask64)fifth[1] << 32;
                    weights = _mm512_mask_add_epi8(weights, set, weights, _mm512_set1_epi8(16));
                }
                if (has_min(type)) {
                    memcpy(&h[0], first + 2, 2);
                    memcpy(&h[1], second + 2, 2);
                    coefficient =
                        _mm_cvtph_ps(_mm_cvtsi32_si128((int)(h[0] | (uint32_t)h[1] << 16)));
                } else {
                    coefficient = _mm_mul_ps(_mm_set1_ps(offset_of(type)), d);
                }
            }
            for (int r = 0; r < count; r++) {
                __m512i xr = x[r];
                if (type == TYPE_Q8_0)
                    xr = _mm512_mask_sub_epi8(xr, negative, zero, xr);
#if BLOCKS_VNNI
                __m512i sums4 = _mm512_dpbusd_epi32(zero, weights, xr);
#else
                __m512i sums4 = _mm512_madd_epi16(_mm512_maddubs_epi16(weights, xr), ones);
#endif
                __m512 scale = _mm512_permutexvar_ps(
                    halves, _mm512_castps128_ps512(_mm_mul_ps(d, activation[r])));
                wide[k][r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sums4), wide[k][r]);
                if (type != TYPE_Q8_0)
                    offsets[k][r] = _mm_fmadd_ps(coefficient, total[r], offsets[k][r]);
            }
        }
    }
    for (int k = 0; k < wrows; k++)
        for (int r = 0; r < count; r++) {
            __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(wide[k][r]), 1));
            acc[k][r] = _mm256_add_ps(acc[k][r], _mm256_add_ps(_mm512_castps512_ps256(wide[k][r]), upper));
            extra[k][r] += _mm_cvtss_f32(offsets[k][r]) +
                           _mm_cvtss_f32(_mm_movehdup_ps(offsets[k][r]));
        }
    return b;
}
#endif

/*
 * A tile: `wrows` weight rows (row_bytes apart, from w) by `count` (1..TILE) quantized rows,
 * results into dot[weight row][row]. Inlined with `type`, `wrows` and `count` constant
 * (tiles()), so each case is a loop of its own whose sums stay in registers. Several weight
 * rows at once keep several independent chains of multiply-adds in flight (one row's chain
 * is bound by the latency of its adds, about 5 cycles a block).
 */
static inline __attribute__((always_inline)) void tile(
    int type, int wrows, int count, const uint8_t *w, ptrdiff_t row_bytes, ptrdiff_t blocks,
    const int8_t *q, ptrdiff_t in_features, const float *scales, const float *sums,
    float dot[WROWS][TILE]) {
    ptrdiff_t size = block_bytes(type);
    float extra[WROWS][TILE] = {{0}};
#if BLOCKS_AVX2
    __m256 acc[WROWS][TILE];
    for (int k = 0; k < WROWS; k++)
        for (int r = 0; r < TILE; r++)
            acc[k][r] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    ptrdiff_t b = 0;
#if BLOCKS_AVX512
    b = pairs(type, wrows, count, w, row_bytes, blocks, q, in_features, scales, sums, acc, extra);
#endif
    for (; b < blocks; b++) {
        __m256i x[TILE];
        for (int r = 0; r < count; r++)
            x[r] = _mm256_loadu_si256((const __m256i *)(q + r * in_features + b * BLOCK));
        for (int k = 0; k < wrows; k++) {
            const uint8_t *block = w + k * row_bytes + b * size;
            float d = half_to_float(block), coefficient = 0.0f;
            __m256i weights, signs = _mm256_setzero_si256();
            if (type == TYPE_Q8_0) {
                signs = _mm256_loadu_si256((const __m256i *)(block + 2));
                weights = _mm256_sign_epi8(signs, signs); /* |q_w|, unsigned */
            } else {
                __m128i packed = _mm_loadu_si128((const __m128i *)(block + nibbles_at(type)));
                weights =
                    _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low);
                if (has_fifth(type)) { /* byte i of 32 takes bit i of h: 16 where it is set */
                    uint32_t h;
                    memcpy(&h, block + nibbles_at(type) - 4, sizeof h);
                    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
                    __m256i spread = _mm256_shuffle_epi8(
                        _mm256_set1_epi32((int)h),
                        _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                          0x0101010101010101LL, 0));
                    spread = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
                    weights = _mm256_or_si256(weights,
                                              _mm256_and_si256(spread, _mm256_set1_epi8(16)));
                }
                coefficient = has_min(type) ? half_to_float(block + 2) : offset_of(type) * d;
            }
            for (int r = 0; r < count; r++) {
                __m256i xr = type == TYPE_Q8_0 ? _mm256_sign_epi8(x[r], signs) : x[r];
                __m256i pairs = _mm256_madd_epi16(_mm256_maddubs_epi16(weights, xr), ones);
                acc[k][r] = _mm256_fmadd_ps(_mm256_set1_ps(d * scales[r * blocks + b]),
                                            _mm256_cvtepi32_ps(pairs), acc[k][r]);
                if (type != TYPE_Q8_0)
                    extra[k][r] += coefficient * sums[r * blocks + b];
            }
        }
    }
    for (int k = 0; k < wrows; k++) {
        for (int r = 0; r < count; r++) {
            __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc[k][r]),
                                     _mm256_extractf128_ps(acc[k][r], 1));
            half = _mm_add_ps(half, _mm_movehl_ps(half, half));
            half = _mm_add_ss(half, _mm_movehdup_ps(half));
            dot[k][r] = _mm_cvtss_f32(half) + extra[k][r];
        }
    }
#else
    float acc[WROWS][TILE] = {{0}};
    for (ptrdiff_t b = 0; b < blocks; b++) {
        for (int k = 0; k < wrows; k++) {
            const uint8_t *block = w + k * row_bytes + b * size;
            float d = half_to_float(block), coefficient = 0.0f;
            int8_t weights[BLOCK];
            if (type == TYPE_Q8_0) {
                memcpy(weights, block + 2, BLOCK);
            } else {
                const uint8_t *nibbles = block + nibbles_at(type);
                uint32_t h = 0;
                if (has_fifth(type))
                    memcpy(&h, nibbles - 4, sizeof h);
                for (int i = 0; i < BLOCK / 2; i++) {
                    weights[i] = (int8_t)((nibbles[i] & 0x0f) | ((h >> i) & 1) << 4);
                    weights[i + BLOCK / 2] =
                        (int8_t)((nibbles[i] >> 4) | ((h >> (i + BLOCK / 2)) & 1) << 4);
                }
                coefficient = has_min(type) ? half_to_float(block + 2) : offset_of(type) * d;
            }
            for (int r = 0; r < count; r++) {
                const int8_t *x = q + r * in_features + b * BLOCK;
                int32_t total = 0;
                for (int i = 0; i < BLOCK; i++)
                    total += (int32_t)weights[i] * (int32_t)x[i];
                acc[k][r] += d * scales[r * blocks + b] * (float)total;
                extra[k][r] += coefficient * sums[r * blocks + b];
            }
        }
    }
    for (int k = 0; k < wrows; k++)
        for (int r = 0; r < count; r++)
            dot[k][r] = acc[k][r] + extra[k][r];
#endif
}

/*
 * tile() for the K types: `supers` super-blocks a weight row, each eight sub-blocks of 32
 * weights against eight activation blocks. Each weight row's d (and the mins' share) is
 * read once a super-block; each sub-block is unpacked once per tile, as tile() does.
 */
static inline __attribute__((always_inline)) void super_tile(
    int type, int wrows, int count, const uint8_t *w, ptrdiff_t row_bytes, ptrdiff_t supers,
    const int8_t *q, ptrdiff_t in_features, const float *scales, const float *sums,
    float dot[WROWS][TILE]) {
    ptrdiff_t size = block_bytes(type), blocks = supers * (SUPER / BLOCK);
#if BLOCKS_AVX2
    __m256 acc[WROWS][TILE];
    for (int k = 0; k < WROWS; k++)
        for (int r = 0; r < TILE; r++)
            acc[k][r] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0f), three = _mm256_set1_epi8(3),
                  one = _mm256_set1_epi8(1), offset = _mm256_set1_epi8(32);
#if BLOCKS_AVX512
    __m512 wide[WROWS][TILE]; /* lanes 0-7: the even sub-blocks' sums, 8-15 the odd ones' */
    for (int k = 0; k < WROWS; k++)
        for (int r = 0; r < TILE; r++)
            wide[k][r] = _mm512_setzero_ps();
#endif
    for (ptrdiff_t s = 0; s < supers; s++) {
        float d[WROWS];
        __m128i sub_scales[WROWS]; /* Q4_K/Q5_K: the 8 scales (bytes); Q6_K: the 16 (int8) */
        for (int k = 0; k < wrows; k++) {
            const uint8_t *block = w + k * row_bytes + s * size;
            if (type == TYPE_Q6_K) {
                d[k] = half_to_float(block + 208);
                sub_scales[k] = _mm_loadu_si128((const __m128i *)(block + 192));
                continue;
            }
            d[k] = half_to_float(block);
            /* scale_min() for the eight sub-blocks at once, four bytes a word (x86 is
             * little-endian): scales, then mins. */
            uint32_t s3[3], packed[4];
            memcpy(s3, block + 4, sizeof s3);
            const uint32_t six = 0x3f3f3f3fu, four = 0x0f0f0f0fu, two = 0x03030303u;
            packed[0] = s3[0] & six;
            packed[1] = (s3[2] & four) | (((s3[0] >> 6) & two) << 4);
            packed[2] = s3[1] & six;
            packed[3] = ((s3[2] >> 4) & four) | (((s3[1] >> 6) & two) << 4);
            sub_scales[k] = _mm_loadl_epi64((const __m128i *)packed);
            /* - dmin m_j (d_x sum q_x) for the eight sub-blocks at once. */
            __m256i mins = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(packed + 2)));
            __m256 m = _mm256_mul_ps(_mm256_set1_ps(-half_to_float(block + 2)),
                                     _mm256_cvtepi32_ps(mins));
            for (int r = 0; r < count; r++)
                acc[k][r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(sums + r * blocks + s * 8),
                                            acc[k][r]);
        }
        /* Every row count sums alike: each sub-block's sums times d times the activation
         * scale, into the row's sum (a decode's one row once took d out of its super-block,
         * a multiply less a sub-block, and so summed another way than the same row among
         * others: greedy answers changed with the traffic). The sub-block loop unrolled: the
         * shifts and shuffles that pick sub-block j become constants (Q6_K: 35 to 19
         * instructions a 32-weight block by one row, Q4_K 23 to 17 with the word-wise
         * scale_min; Q4_1's tile takes 19) for 2.6 s more compile (6.2 s CPU, once a
         * machine; callgrind, GCC 12, Zen 3). */
#if BLOCKS_AVX512
        /*
         * Sub-blocks two at a time, j and j + 1 side by side in 512-bit vectors, as pairs()
         * takes the 32-blocks: the same integer sums as below (VPMADDUBSW, then VPMADDWD by
         * the halves' scales), each lane's float32 chain taking every other sub-block, and
         * the two chains added at the end, so a row sums alike whatever the tile's shape.
         * A pair's weights come from one load: Q4_K/Q5_K's low and high nibbles of the same
         * 32 bytes, Q6_K's 64 consecutive low bytes (and one 32-byte load of high bits).
         * Not VPDPBUSD with VNNI: it sums four products where the halves' scales must
         * multiply each two (VPMADDWD), and a 32-bit multiply after it costs what it saves.
         * Q6_K's signs move onto the activations (no VPSIGNB: pairs()' masked subtraction).
         */
        {
            __m512i scale16[WROWS]; /* the sub-block (Q6_K: half) scales, 16-bit words */
            for (int k = 0; k < wrows; k++)
                scale16[k] = type == TYPE_Q6_K
                                 ? _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sub_scales[k]))
                                 : _mm512_castsi128_si512(_mm_cvtepu8_epi16(sub_scales[k]));
            const __m512i nibble = _mm512_set1_epi8(0x0f), zero = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int p = 0; p < SUPER / BLOCK / 2; p++) {
                int j = 2 * p;
                ptrdiff_t b = s * (SUPER / BLOCK) + j;
                /* Lanes 0-7 take scale 2p of a super-block's eight, 8-15 scale 2p + 1; words
                 * 0-15 the scale(s) of sub-block j, 16-31 those of j + 1. */
                const __m512i lanes = _mm512_set_epi32(
                    j + 1, j + 1, j + 1, j + 1, j + 1, j + 1, j + 1, j + 1, j, j, j, j, j, j, j, j);
                const __m512i words =
                    type == TYPE_Q6_K
                        ? _mm512_set_epi16(
                              2 * j + 3, 2 * j + 3, 2 * j + 3, 2 * j + 3, 2 * j + 3, 2 * j + 3,
                              2 * j + 3, 2 * j + 3, 2 * j + 2, 2 * j + 2, 2 * j + 2, 2 * j + 2,
                              2 * j + 2, 2 * j + 2, 2 * j + 2, 2 * j + 2, 2 * j + 1, 2 * j + 1,
                              2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1,
                              2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j)
                        : _mm512_inserti64x4(_mm512_set1_epi16((short)j),
                                             _mm256_set1_epi16((short)(j + 1)), 1);
                __m512i x[TILE];
                __m512 activation[TILE]; /* the two blocks' scales, each in its 8 lanes */
                for (int r = 0; r < count; r++) {
                    x[r] = _mm512_loadu_si512((const void *)(q + r * in_features + b * BLOCK));
                    activation[r] = _mm512_permutexvar_ps(
                        lanes, _mm512_castps256_ps512(
                                   _mm256_loadu_ps(scales + r * blocks + s * (SUPER / BLOCK))));
                }
                for (int k = 0; k < wrows; k++) {
                    const uint8_t *block = w + k * row_bytes + s * size;
                    __m512i weights;
                    __mmask64 negative = 0;
                    if (type == TYPE_Q6_K) {
                        /* c = j % 4 is 0 or 2: sub-blocks j, j + 1 are the low (c = 0) or
                         * high halves of l[64 (j / 4) ..] and bits 2c.., 2c + 2.. of h. */
                        int c = j % 4;
                        __m512i l = _mm512_loadu_si512((const void *)(block + 64 * (j / 4)));
                        if (c >= 2)
                            l = _mm512_srli_epi16(l, 4);
                        __m256i h =
                            _mm256_loadu_si256((const __m256i *)(block + 128 + 32 * (j / 4)));
                        __m512i high = _mm512_inserti64x4(
                            _mm512_castsi256_si512(_mm256_srli_epi16(h, 2 * c)),
                            _mm256_srli_epi16(h, 2 * c + 2), 1);
                        high = _mm512_and_si512(high, _mm512_set1_epi8(3));
                        __m512i signs = _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(l, nibble),
                                                                        _mm512_slli_epi16(high, 4)),
                                                        _mm512_set1_epi8(32));
                        weights = _mm512_abs_epi8(signs);
                        negative = _mm512_movepi8_mask(signs);
                    } else {
                        __m256i n = _mm256_loadu_si256(
                            (const __m256i *)(block + (type == TYPE_Q5_K ? 48 : 16) + 32 * (j / 2)));
                        weights = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(n),
                                                                      _mm256_srli_epi16(n, 4), 1),
                                                   nibble);
                        if (type == TYPE_Q5_K) {
                            __m256i h = _mm256_loadu_si256((const __m256i *)(block + 16));
                            __m512i fifth = _mm512_inserti64x4(
                                _mm512_castsi256_si512(_mm256_srli_epi16(h, j)),
                                _mm256_srli_epi16(h, j + 1), 1);
                            fifth = _mm512_and_si512(fifth, _mm512_set1_epi8(1));
                            weights = _mm512_or_si512(weights, _mm512_slli_epi16(fifth, 4));
                        }
                    }
                    __m512i scale = _mm512_permutexvar_epi16(words, scale16[k]);
                    __m512 dk = _mm512_set1_ps(d[k]);
                    for (int r = 0; r < count; r++) {
                        __m512i xr = x[r];
                        if (type == TYPE_Q6_K)
                            xr = _mm512_mask_sub_epi8(xr, negative, zero, xr);
                        __m512i sums2 =
                            _mm512_madd_epi16(_mm512_maddubs_epi16(weights, xr), scale);
                        wide[k][r] = _mm512_fmadd_ps(_mm512_mul_ps(dk, activation[r]),
                                                     _mm512_cvtepi32_ps(sums2), wide[k][r]);
                    }
                }
            }
        }
#else
#pragma GCC unroll 8
        for (int j = 0; j < SUPER / BLOCK; j++) {
            ptrdiff_t b = s * (SUPER / BLOCK) + j;
            __m256i x[TILE];
            for (int r = 0; r < count; r++)
                x[r] = _mm256_loadu_si256((const __m256i *)(q + r * in_features + b * BLOCK));
            for (int k = 0; k < wrows; k++) {
                const uint8_t *block = w + k * row_bytes + s * size;
                __m256i weights, scale, signs = _mm256_setzero_si256();
                if (type == TYPE_Q6_K) {
                    int c = j % 4;
                    __m256i l = _mm256_loadu_si256(
                        (const __m256i *)(block + 64 * (j / 4) + 32 * (c % 2)));
                    __m256i h = _mm256_loadu_si256((const __m256i *)(block + 128 + 32 * (j / 4)));
                    if (c >= 2)
                        l = _mm256_srli_epi16(l, 4);
                    h = _mm256_and_si256(_mm256_srli_epi16(h, 2 * c), three);
                    signs = _mm256_sub_epi8(
                        _mm256_or_si256(_mm256_and_si256(l, low), _mm256_slli_epi16(h, 4)), offset);
                    weights = _mm256_sign_epi8(signs, signs); /* |q_w|, unsigned */
                    /* Bytes 2j (8 times), 2j + 1 (8 times), widened: the halves' scales. */
                    __m128i pick = _mm_set_epi64x(0x0101010101010101LL * (2 * j + 1),
                                                  0x0101010101010101LL * (2 * j));
                    scale = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sub_scales[k], pick));
                } else {
                    const uint8_t *nibbles = block + (type == TYPE_Q5_K ? 48 : 16) + 32 * (j / 2);
                    __m256i n = _mm256_loadu_si256((const __m256i *)nibbles);
                    if (j % 2)
                        n = _mm256_srli_epi16(n, 4);
                    weights = _mm256_and_si256(n, low);
                    if (type == TYPE_Q5_K) {
                        __m256i h = _mm256_loadu_si256((const __m256i *)(block + 16));
                        h = _mm256_and_si256(_mm256_srli_epi16(h, j), one);
                        weights = _mm256_or_si256(weights, _mm256_slli_epi16(h, 4));
                    }
                    scale = _mm256_cvtepu8_epi16(
                        _mm_shuffle_epi8(sub_scales[k], _mm_set1_epi8((char)j)));
                }
                for (int r = 0; r < count; r++) {
                    __m256i xr = type == TYPE_Q6_K ? _mm256_sign_epi8(x[r], signs) : x[r];
                    __m256i pairs = _mm256_madd_epi16(_mm256_maddubs_epi16(weights, xr), scale);
                    acc[k][r] = _mm256_fmadd_ps(_mm256_set1_ps(d[k] * scales[r * blocks + b]),
                                                _mm256_cvtepi32_ps(pairs), acc[k][r]);
                }
            }
        }
#endif
    }
    for (int k = 0; k < wrows; k++) {
        for (int r = 0; r < count; r++) {
#if BLOCKS_AVX512
            __m256 upper =
                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(wide[k][r]), 1));
            acc[k][r] = _mm256_add_ps(acc[k][r],
                                      _mm256_add_ps(_mm512_castps512_ps256(wide[k][r]), upper));
#endif
            __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc[k][r]),
                                     _mm256_extractf128_ps(acc[k][r], 1));
            half = _mm_add_ps(half, _mm_movehl_ps(half, half));
            half = _mm_add_ss(half, _mm_movehdup_ps(half));
            dot[k][r] = _mm_cvtss_f32(half);
        }
    }
#else
    float acc[WROWS][TILE] = {{0}};
    for (ptrdiff_t s = 0; s < supers; s++) {
        for (int k = 0; k < wrows; k++) {
            const uint8_t *block = w + k * row_bytes + s * size;
            float d = half_to_float(type == TYPE_Q6_K ? block + 208 : block);
            float dmin = type == TYPE_Q6_K ? 0.0f : half_to_float(block + 2);
            for (int j = 0; j < SUPER / BLOCK; j++) {
                ptrdiff_t b = s * (SUPER / BLOCK) + j;
                int8_t weights[BLOCK];
                int scale[2], min;
                sub_block(type, block, j, weights, scale, &min);
                for (int r = 0; r < count; r++) {
                    const int8_t *x = q + r * in_features + b * BLOCK;
                    int32_t first = 0, second = 0;
                    for (int i = 0; i < BLOCK / 2; i++) {
                        first += (int32_t)weights[i] * (int32_t)x[i];
                        second += (int32_t)weights[i + BLOCK / 2] * (int32_t)x[i + BLOCK / 2];
                    }
                    float total = (float)(scale[0] * first + scale[1] * second); /* < 2^24 */
                    acc[k][r] += d * scales[r * blocks + b] * total;
                    acc[k][r] -= dmin * (float)min * sums[r * blocks + b];
                }
            }
        }
    }
    for (int k = 0; k < wrows; k++)
        for (int r = 0; r < count; r++)
            dot[k][r] = acc[k][r];
#endif
}

BLOCK_SUMS_END

/*
 * Float activations (twostroke_block_linear_float): the products of the file's weights by
 * the activations themselves, as the float32 reference (the file dequantized) computes them
 * up to the order of the additions. A weight block (a K sub-block) is dequantized in
 * registers once per tile, into VECTORS float vectors of LANES lanes (GCC's vector types:
 * one 512-bit register a vector with AVX-512, 256 bits with AVX2, 128 in portable C), as
 * twostroke_block_rows() computes its values (d q + m, (d sc) q - dmin m); then each row of
 * the tile takes VECTORS multiply-adds a block into a sum of LANES lanes.
 *
 * Compiled without reassociation or contraction (EXACT_SUMS_BEGIN): with them, each tile
 * shape was vectorized and fused its own way.
 * Measured on SmolLM2's Q4_1 file, one stream: 15.9-16.7 ms a token with the fast flags,
 * 14.6-15.4 without.
 */
EXACT_SUMS_BEGIN
#if BLOCKS_AVX512
#define LANES 16
#elif BLOCKS_AVX2
#define LANES 8
#else
#define LANES 4
#endif
#define VECTORS (BLOCK / LANES)
typedef float vfloat __attribute__((vector_size(4 * LANES)));
typedef int32_t vint __attribute__((vector_size(4 * LANES)));

/* LANES bytes widened to 32 bits (zero- or sign-extended): one instruction with AVX2 or
 * AVX-512 (GCC widens a vector type's lanes one by one). */
static inline __attribute__((always_inline)) vint widen(const uint8_t *p, int is_signed) {
    vint out;
#if BLOCKS_AVX512
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    __m512i wide = is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
    memcpy(&out, &wide, sizeof out);
#elif BLOCKS_AVX2
    __m128i v = _mm_loadl_epi64((const __m128i *)p);
    __m256i wide = is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
    memcpy(&out, &wide, sizeof out);
#else
    for (int i = 0; i < LANES; i++)
        out[i] = is_signed ? (int32_t)(int8_t)p[i] : (int32_t)p[i];
#endif
    return out;
}

/* Bits first .. first + LANES - 1 of h, one a lane, times 16. */
static inline __attribute__((always_inline)) vint fifth_bits(uint32_t h, int first) {
    vint lane;
    for (int i = 0; i < LANES; i++)
        lane[i] = i;
    vint bits = (vint){0} + (int32_t)(h >> first);
    return ((bits >> lane) & 1) << 4;
}

/*
 * The 32 float weights of 32-weight unit u of a weight row (`row`: a 32-block; K types: a
 * sub-block u % 8 of super-block u / 8), in order, LANES a vector, into w.
 */
static inline __attribute__((always_inline)) void unpack_float(int type, const uint8_t *row,
                                                               ptrdiff_t u, vfloat w[VECTORS]) {
    if (!is_super(type)) {
        const uint8_t *block = row + u * block_bytes(type);
        float d = half_to_float(block);
        if (type == TYPE_Q8_0) {
            for (int v = 0; v < VECTORS; v++)
                w[v] = __builtin_convertvector(widen(block + 2 + v * LANES, 1), vfloat) * d;
            return;
        }
        const uint8_t *nibbles = block + nibbles_at(type);
#if BLOCKS_AVX512
        /* The block's 16 (Q5: 32) possible weights, d v + m, a table that VPERMPS (Q5:
         * VPERMT2PS) reads by each lane's value: the same float per value as the vector
         * code below computes, for fewer instructions (no conversions; the low nibble
         * needs no mask, VPERMPS reading the index's low 4 bits). */
        const __m512 values = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        __m512 scale = _mm512_set1_ps(d);
        __m512 offset = has_min(type) ? _mm512_set1_ps(half_to_float(block + 2))
                                      : _mm512_setzero_ps();
        __m512 shift = _mm512_set1_ps(has_min(type) ? 0.0f : offset_of(type));
        __m512 table = _mm512_fmadd_ps(_mm512_add_ps(values, shift), scale, offset);
        __m512i packed = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)nibbles));
        __m512i high = _mm512_srli_epi32(packed, 4);
        __m512 out[2];
        if (!has_fifth(type)) {
            out[0] = _mm512_permutexvar_ps(packed, table);
            out[1] = _mm512_permutexvar_ps(high, table);
        } else {
            __m512 upper = _mm512_fmadd_ps(
                _mm512_add_ps(values, _mm512_add_ps(shift, _mm512_set1_ps(16.0f))), scale,
                offset);
            uint32_t h;
            memcpy(&h, nibbles - 4, sizeof h);
            __m512i sixteen = _mm512_set1_epi32(16);
            __m512i low = _mm512_and_si512(packed, _mm512_set1_epi32(15));
            low = _mm512_mask_or_epi32(low, (__mmask16)(h & 0xffff), low, sixteen);
            high = _mm512_mask_or_epi32(high, (__mmask16)(h >> 16), high, sixteen);
            out[0] = _mm512_permutex2var_ps(table, low, upper);
            out[1] = _mm512_permutex2var_ps(table, high, upper);
        }
        memcpy(w, out, sizeof out);
#else
        float m = has_min(type) ? half_to_float(block + 2) : 0.0f;
        int offset = has_min(type) ? 0 : (int)offset_of(type);
        uint32_t h = 0;
        if (has_fifth(type))
            memcpy(&h, nibbles - 4, sizeof h);
        for (int v = 0; v < VECTORS; v++) {
            int first = v * LANES % (BLOCK / 2); /* the byte of the vector's first value */
            vint value = widen(nibbles + first, 0);
            value = v < VECTORS / 2 ? value & 15 : value >> 4;
            if (has_fifth(type))
                value |= fifth_bits(h, v * LANES);
            w[v] = __builtin_convertvector(value + offset, vfloat) * d + m;
        }
#endif
        return;
    }
    const uint8_t *block = row + (u / (SUPER / BLOCK)) * block_bytes(type);
    int j = (int)(u % (SUPER / BLOCK));
    if (type == TYPE_Q6_K) { /* see sub_block() */
        int c = j % 4, shift = 4 * (c / 2);
        const uint8_t *low = block + 64 * (j / 4) + 32 * (c % 2), *high = block + 128 + 32 * (j / 4);
        const int8_t *scales = (const int8_t *)(block + 192);
        float d = half_to_float(block + 208);
        for (int v = 0; v < VECTORS; v++) {
            vint value = ((widen(low + v * LANES, 0) >> shift) & 15) |
                         (((widen(high + v * LANES, 0) >> (2 * c)) & 3) << 4);
            float scale = d * (float)scales[2 * j + v * LANES / 16];
            w[v] = __builtin_convertvector(value - 32, vfloat) * scale;
        }
        return;
    }
    const uint8_t *nibbles = block + (type == TYPE_Q5_K ? 48 : 16) + 32 * (j / 2);
    int shift = 4 * (j % 2), scale, min;
    scale_min(block + 4, j, &scale, &min);
    float ds = half_to_float(block) * (float)scale, dm = half_to_float(block + 2) * (float)min;
    for (int v = 0; v < VECTORS; v++) {
        vint value = (widen(nibbles + v * LANES, 0) >> shift) & 15;
        if (type == TYPE_Q5_K)
            value |= ((widen(block + 16 + v * LANES, 0) >> j) & 1) << 4;
        w[v] = __builtin_convertvector(value, vfloat) * ds - dm;
    }
}

/*
 * A tile of float activations: `wrows` weight rows (row_bytes apart, from w) by `count`
 * rows of x (x_stride apart), `units` 32-weight units a row, into dot[weight row][row].
 * Inlined with its shape constant, as tile() is.
 */
static inline __attribute__((always_inline)) void float_tile(
    int type, int wrows, int count, const uint8_t *w, ptrdiff_t row_bytes, ptrdiff_t units,
    const float *x, ptrdiff_t x_stride, float dot[WROWS][TILE]) {
    vfloat acc[WROWS][TILE];
    for (int k = 0; k < WROWS; k++)
        for (int r = 0; r < TILE; r++)
            acc[k][r] = (vfloat){0};
    for (ptrdiff_t u = 0; u < units; u++) {
        vfloat xs[TILE][VECTORS];
        for (int r = 0; r < count; r++)
            memcpy(xs[r], x + r * x_stride + u * BLOCK, sizeof xs[r]);
        for (int k = 0; k < wrows; k++) {
            vfloat weights[VECTORS];
            unpack_float(type, w + k * row_bytes, u, weights);
            for (int r = 0; r < count; r++) /* VECTORS multiply-adds, one sum a row */
                for (int v = 0; v < VECTORS; v++)
                    acc[k][r] += weights[v] * xs[r][v];
        }
    }
    for (int k = 0; k < wrows; k++)
        for (int r = 0; r < count; r++) {
            float total = 0.0f;
            for (int i = 0; i < LANES; i++)
                total += acc[k][r][i];
            dot[k][r] = total;
        }
}

#define TILE_CASE(f, t, k, n)                                                                  \
    f(t, k, n, w, row_bytes, blocks, q, in_features, scales, sums, dot)
/* The tiles block_matmul() takes: 4 weight rows by 1 or 2 rows, 2 by 3 or 4 (8 sums in
 * registers at most), and 1 by 1 for the last 1-3 weight rows of a product. Five shapes a
 * type, each a loop of its own: more would only lengthen the compile (first start). */
#define TILE_SHAPES(CASE, f, t)                                                                      \
    if (wrows == 4 && count == 1)                                                              \
        CASE(f, t, 4, 1);                                                                 \
    else if (wrows == 4)                                                                       \
        CASE(f, t, 4, 2);                                                                 \
    else if (wrows == 2 && count == 3)                                                         \
        CASE(f, t, 2, 3);                                                                 \
    else if (wrows == 2)                                                                       \
        CASE(f, t, 2, 4);                                                                 \
    else                                                                                       \
        CASE(f, t, 1, 1)
_Static_assert(TILE == 4 && WROWS == 4, "TILE_SHAPES takes 4 weight rows by 1-2 rows, 2 by 3-4");

/* tile() or super_tile() with the type and the tile's shape as constants; `blocks` is the
 * weight blocks a row (super-blocks for the K types). */
static void tiles(int type, int wrows, int count, const uint8_t *w, ptrdiff_t row_bytes,
                  ptrdiff_t blocks, const int8_t *q, ptrdiff_t in_features, const float *scales,
                  const float *sums, float dot[WROWS][TILE]) {
    switch (type) {
    case TYPE_Q8_0: TILE_SHAPES(TILE_CASE, tile, TYPE_Q8_0); break;
    case TYPE_Q4_0: TILE_SHAPES(TILE_CASE, tile, TYPE_Q4_0); break;
    case TYPE_Q4_1: TILE_SHAPES(TILE_CASE, tile, TYPE_Q4_1); break;
    case TYPE_Q5_0: TILE_SHAPES(TILE_CASE, tile, TYPE_Q5_0); break;
    case TYPE_Q5_1: TILE_SHAPES(TILE_CASE, tile, TYPE_Q5_1); break;
    case TYPE_Q4_K: TILE_SHAPES(TILE_CASE, super_tile, TYPE_Q4_K); break;
    case TYPE_Q5_K: TILE_SHAPES(TILE_CASE, super_tile, TYPE_Q5_K); break;
    default: TILE_SHAPES(TILE_CASE, super_tile, TYPE_Q6_K); break;
    }
}

#define FLOAT_CASE(f, t, k, n) f(t, k, n, w, row_bytes, units, x, x_stride, dot)

/* float_tile() with the type and the tile's shape as constants (the shapes tiles() takes). */
static void float_tiles(int type, int wrows, int count, const uint8_t *w, ptrdiff_t row_bytes,
                        ptrdiff_t units, const float *x, ptrdiff_t x_stride,
                        float dot[WROWS][TILE]) {
    switch (type) {
    case TYPE_Q8_0: TILE_SHAPES(FLOAT_CASE, float_tile, TYPE_Q8_0); break;
    case TYPE_Q4_0: TILE_SHAPES(FLOAT_CASE, float_tile, TYPE_Q4_0); break;
    case TYPE_Q4_1: TILE_SHAPES(FLOAT_CASE, float_tile, TYPE_Q4_1); break;
    case TYPE_Q5_0: TILE_SHAPES(FLOAT_CASE, float_tile, TYPE_Q5_0); break;
    case TYPE_Q5_1: TILE_SHAPES(FLOAT_CASE, float_tile, TYPE_Q5_1); break;
    case TYPE_Q4_K: TILE_SHAPES(FLOAT_CASE, float_tile, TYPE_Q4_K); break;
    case TYPE_Q5_K: TILE_SHAPES(FLOAT_CASE, float_tile, TYPE_Q5_K); break;
    default: TILE_SHAPES(FLOAT_CASE, float_tile, TYPE_Q6_K); break;
    }
}
EXACT_SUMS_END

/* A call's activations: float32 rows (x, x_stride), and where the products take them
 * quantized (x_float 0), the rows as quantize_row() writes them. */
struct activations {
    const float *x;
    ptrdiff_t x_stride;
    int x_float;
    const int8_t *q;
    const float *scales, *sums;
};

/*
 * out[r][columns[o]] (row stride out_stride) = the product of activation row r by weight row
 * o, for r < rows and o0 <= o < o0 + left (left <= WROWS), the rows of a part of `type`
 * row_bytes apart from `weights`: one group of weight rows, tile by tile of up to TILE rows,
 * by all its weight rows at once for one or two rows (8 sums in registers at most), by two
 * at a time for more; a last group of fewer weight rows takes them one by one. columns NULL
 * is o itself (a permutation of the output columns: GGUF's rotary order of q/k rows undone
 * without touching the blocks).
 */
static void block_group(int type, const struct activations *in, ptrdiff_t rows,
                        ptrdiff_t in_features, const uint8_t *weights, ptrdiff_t row_bytes,
                        ptrdiff_t o0, int left, const int32_t *columns, float *out,
                        ptrdiff_t out_stride) {
    ptrdiff_t count_blocks = in_features / BLOCK, weight_blocks = in_features / block_weights(type);
    /* The next group's rows (this thread's next under the static schedule), asked of the
     * cache while this one is multiplied; past the part's end the hints are harmless. This
     * guest's own prefetching left the products waiting on memory: one decode of SmolLM2's
     * Q4_1 file, 2 threads, Intel Xeon with AMX (`twostroke profile-step --quantization gguf
     * --batch 1`, alternated runs): 13.1-15.0 ms a step without the hints, 9.7-11.8 with
     * them (gguf_f32: 13.7-16.6, 11.4-11.9); at 32 rows, where the products compute more
     * than they read, alike within the noise. */
    const char *next = (const char *)(weights + (o0 + WROWS) * row_bytes);
    for (ptrdiff_t at = 0; at < WROWS * row_bytes; at += 64)
        __builtin_prefetch(next + at, 0, 3);
    for (ptrdiff_t r0 = 0; r0 < rows; r0 += TILE) {
        int rest = rows - r0 < TILE ? (int)(rows - r0) : TILE;
        /* A whole group by the tile; the last group's weight rows one by one, row by row. */
        int wrows = left < WROWS ? 1 : rest <= 2 ? WROWS : 2, count = left < WROWS ? 1 : rest;
        for (int r1 = 0; r1 < rest; r1 += count) {
            ptrdiff_t row = r0 + r1;
            for (int k0 = 0; k0 < left; k0 += wrows) {
                float dot[WROWS][TILE] = {{0}};
                const uint8_t *w = weights + (o0 + k0) * row_bytes;
                if (in->x_float)
                    float_tiles(type, wrows, count, w, row_bytes, count_blocks,
                                in->x + row * in->x_stride, in->x_stride, dot);
                else
                    tiles(type, wrows, count, w, row_bytes, weight_blocks,
                          in->q + row * in_features, in_features,
                          in->scales + row * count_blocks, in->sums + row * count_blocks, dot);
                for (int k = 0; k < wrows; k++) {
                    ptrdiff_t o = o0 + k0 + k, column = columns ? columns[o] : o;
                    for (int r = 0; r < count; r++)
                        out[(row + r) * out_stride + column] = dot[k][r];
                }
            }
        }
    }
}

/* The most parts a projection may have (q/k/v: 3; the gate and up of a token's experts: 2 top-k,
 * engine.models.experts). */
#define MAX_PARTS 64

/*
 * out[rows][...] (row stride out_stride) = x W^T for a projection of `count` parts side by
 * side (q/k/v, gate/up: each part's columns from its offset), whose blocks of each part's
 * type are contiguous from its `blocks` (in_features / 32 blocks a row, K types / 256).
 * x_float 0: x's rows (row stride x_stride) quantized once, in scratch memory of this call's
 * own, then multiplied by each part; 1: multiplied as they are (float_tile()). One call a
 * projection, and one parallel region a call: the team quantizes the rows, then splits the
 * groups of WROWS weight rows of every part (so a decode step wakes the team once a
 * projection, not once a part and once more for the rows). Returns 0; 1 for a part of a
 * type it does not compute, whose blocks do not tile a row of in_features, or more than
 * MAX_PARTS parts (nothing is written); 2 if the scratch memory could not be allocated.
 */
static int block_linear(const float *x, ptrdiff_t x_stride, ptrdiff_t rows,
                        ptrdiff_t in_features, const struct twostroke_block_part *parts,
                        ptrdiff_t count, float *out, ptrdiff_t out_stride, int x_float) {
    if (count > MAX_PARTS)
        return 1;
    ptrdiff_t first[MAX_PARTS + 1] = {0}, out_features = 0; /* each part's first group */
    for (ptrdiff_t p = 0; p < count; p++) {
        if (!block_bytes(parts[p].type) || in_features % block_weights(parts[p].type))
            return 1;
        first[p + 1] = first[p] + (parts[p].out_features + WROWS - 1) / WROWS;
        out_features += parts[p].out_features;
    }
    if (rows <= 0)
        return 0;
    ptrdiff_t blocks = in_features / BLOCK, groups = first[count];
    struct activations in = {x, x_stride, x_float, NULL, NULL, NULL};
    int8_t *q = NULL;
    float *scales = NULL;
    if (!x_float) {
        q = malloc((size_t)(rows * in_features));
        scales = malloc(sizeof(float) * (size_t)(2 * rows * blocks));
        if (!q || !scales) {
            free(q);
            free(scales);
            return 2;
        }
        in.q = q;
        in.scales = scales;
        in.sums = scales + rows * blocks;
    }
    int parallel = groups > 1 && rows * in_features * out_features >= PARALLEL_WORK;
#pragma omp parallel if (parallel)
    {
        if (!x_float) {
#pragma omp for schedule(static)
            for (ptrdiff_t r = 0; r < rows; r++)
                quantize_row(x, x_stride, r, in_features, q, scales, scales + rows * blocks);
        }
#pragma omp for schedule(static)
        for (ptrdiff_t g = 0; g < groups; g++) {
            ptrdiff_t p = 0;
            while (g >= first[p + 1])
                p++;
            const struct twostroke_block_part *part = &parts[p];
            ptrdiff_t o0 = (g - first[p]) * WROWS;
            int left = part->out_features - o0 < WROWS ? (int)(part->out_features - o0) : WROWS;
            ptrdiff_t row_bytes = in_features / block_weights(part->type) * block_bytes(part->type);
            block_group(part->type, &in, rows, in_features, (const uint8_t *)part->blocks,
                        row_bytes, o0, left, part->columns, out + part->offset, out_stride);
        }
    }
    free(q);
    free(scales);
    return 0;
}

/* block_linear() of activations quantized per block (as llama.cpp computes). */
int twostroke_block_linear(const float *x, ptrdiff_t x_stride, ptrdiff_t rows,
                           ptrdiff_t in_features, const struct twostroke_block_part *parts,
                           ptrdiff_t count, float *out, ptrdiff_t out_stride) {
    return block_linear(x, x_stride, rows, in_features, parts, count, out, out_stride, 0);
}

/* block_linear() of the float32 activations themselves. */
int twostroke_block_linear_float(const float *x, ptrdiff_t x_stride, ptrdiff_t rows,
                                 ptrdiff_t in_features, const struct twostroke_block_part *parts,
                                 ptrdiff_t count, float *out, ptrdiff_t out_stride) {
    return block_linear(x, x_stride, rows, in_features, parts, count, out, out_stride, 1);
}

/*
 * The decoder stack's projection (kernels.h's twostroke_stack_projection_fn where element is
 * float): twostroke_block_linear() or twostroke_block_linear_float(), as its
 * float_activations says, by the parts `weight` (a struct twostroke_block_weight) holds, plus
 * bias where it is not NULL. out_features is the parts' together (the stack's
 * builder checks it). Returns block_linear()'s result.
 */
int twostroke_block_projection(const float *x, ptrdiff_t x_stride, ptrdiff_t rows,
                               ptrdiff_t in_features, const void *weight, ptrdiff_t out_features,
                               const float *bias, float *out, ptrdiff_t out_stride) {
    const struct twostroke_block_weight *parts = weight;
    int failed = block_linear(x, x_stride, rows, in_features, parts->parts, parts->count, out,
                              out_stride, parts->float_activations);
    if (failed || bias == NULL)
        return failed;
    for (ptrdiff_t r = 0; r < rows; r++)
        for (ptrdiff_t o = 0; o < out_features; o++)
            out[r * out_stride + o] += bias[o];
    return 0;
}

/*
 * out[i][in_features] = weight row ids[i] dequantized: the embedding's lookup (only the rows
 * a step needs), and a whole weight for the products by many rows (gguf_blocks.py's dense
 * path), which the team splits. Returns 0, or 1 for a type it does not read (or in_features
 * not a whole number of its blocks).
 */
/* One stored row's values, as gguf's dequantization computes them, into `values`
 * [per_row * the type's weights a block]. */
static void dequantize_row(int type, const uint8_t *row, ptrdiff_t per_row, ptrdiff_t size,
                           float *values) {
    for (ptrdiff_t b = 0; b < per_row; b++) {
        const uint8_t *block = row + b * size;
        if (is_super(type)) { /* as gguf computes it: (d sc) q - (dmin m) */
            float d = half_to_float(type == TYPE_Q6_K ? block + 208 : block);
            float dmin = type == TYPE_Q6_K ? 0.0f : half_to_float(block + 2);
            for (int j = 0; j < SUPER / BLOCK; j++) {
                int8_t weights[BLOCK];
                int scale[2], min;
                sub_block(type, block, j, weights, scale, &min);
                float *v = values + b * SUPER + j * BLOCK;
                for (int t = 0; t < BLOCK; t++)
                    v[t] = (d * (float)scale[t / 16]) * (float)weights[t] - dmin * (float)min;
            }
            continue;
        }
        float d = half_to_float(block);
        float *v = values + b * BLOCK;
        if (type == TYPE_Q8_0) {
            for (int j = 0; j < BLOCK; j++)
                v[j] = d * (float)(int8_t)block[2 + j];
        } else {
            const uint8_t *nibbles = block + nibbles_at(type);
            float m = has_min(type) ? half_to_float(block + 2) : 0.0f;
            int offset = has_min(type) ? 0 : -(int)offset_of(type);
            uint32_t h = 0;
            if (has_fifth(type))
                memcpy(&h, nibbles - 4, sizeof h);
            for (int j = 0; j < BLOCK / 2; j++) {
                int low = (nibbles[j] & 0x0f) | (int)((h >> j) & 1) << 4;
                int high = (nibbles[j] >> 4) | (int)((h >> (j + BLOCK / 2)) & 1) << 4;
                v[j] = d * (float)(low - offset) + m;
                v[j + BLOCK / 2] = d * (float)(high - offset) + m;
            }
        }
    }
}

int twostroke_block_rows(int type, const void *blocks, ptrdiff_t in_features,
                         const int64_t *ids, ptrdiff_t count, float *out) {
    ptrdiff_t size = block_bytes(type);
    if (!size || in_features % block_weights(type))
        return 1;
    ptrdiff_t per_row = in_features / block_weights(type);
#pragma omp parallel for if (count * in_features >= PARALLEL_WORK) schedule(static)
    for (ptrdiff_t i = 0; i < count; i++) {
        const uint8_t *row = (const uint8_t *)blocks + ids[i] * per_row * size;
        dequantize_row(type, row, per_row, size, out + i * in_features);
    }
    return 0;
}

/* float32 to bfloat16 bits, rounded to nearest even as torch's `.to(torch.bfloat16)` rounds
 * (a NaN to the quiet NaN torch gives). */
static inline uint16_t to_bfloat16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

int twostroke_block_rows_bf16(int type, const void *blocks, ptrdiff_t in_features,
                              const int64_t *ids, ptrdiff_t count, uint16_t *out) {
    ptrdiff_t size = block_bytes(type);
    if (!size || in_features % block_weights(type))
        return 1;
    ptrdiff_t per_row = in_features / block_weights(type);
    int failed = 0;
#pragma omp parallel if (count * in_features >= PARALLEL_WORK)
    {
        float *values = malloc(sizeof(float) * (size_t)in_features);
        if (values == NULL) {
#pragma omp atomic write
            failed = 2;
        }
#pragma omp for schedule(static)
        for (ptrdiff_t i = 0; i < count; i++) {
            if (values == NULL)
                continue;
            const uint8_t *row = (const uint8_t *)blocks + ids[i] * per_row * size;
            dequantize_row(type, row, per_row, size, values);
            uint16_t *to = out + i * in_features;
            for (ptrdiff_t j = 0; j < in_features; j++)
                to[j] = to_bfloat16(values[j]);
        }
        free(values);
    }
    return failed;
}
