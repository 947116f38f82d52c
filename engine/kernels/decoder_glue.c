/* The decoder's element-wise glue on the CPU: what sits between its matrix products.
 *
 * twostroke.engine.kernels.glue compiles this file at run time with the machine's C
 * compiler, once per model shape and element type, and caches the library (see
 * twostroke.engine.kernels.build):
 *
 *   -DHIDDEN=576 -DHEAD_DIM=64   the width of the residual stream and of a head
 *   -DELEMENT_BF16               bfloat16 tensors (else float; see native_element.h)
 *
 * In torch each of these is several operators, each a pass over the rows and a call from
 * Python that hands the GIL back and forth with the engine's bookkeeping stroke: a residual
 * add and ``rms_norm`` (five operators on the CPU, two casts more in bfloat16); rotary
 * embeddings (a roll, two products and a sum) and the cache write (an ``index_put_``);
 * SiLU and the product with the up projection. Here each is one call, one pass.
 *
 * The arithmetic is transformers' in float32 whatever the element type, rounded to the
 * element type wherever torch rounds (after every operator). It is compiled without
 * contracting products into FMAs (-ffp-contract=off), so the rotary embeddings are
 * transformers' bit for bit; the norm's mean is summed in another order than torch's and
 * SiLU's exp is a polynomial, so those agree to float32 rounding.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#if !defined(HIDDEN) || !defined(HEAD_DIM)
#error "compile with -DHIDDEN= and -DHEAD_DIM="
#endif

/* Below this many elements a call stays on the calling thread: waking the thread team
 * costs a few microseconds, more than a small call saves by it (a decode step's norm of
 * 32 x 576 takes about 4 us alone; its SiLU of 32 x 1536, with an exp per element, 29). */
#define PARALLEL_ELEMENTS 24576

#define HALF (HEAD_DIM / 2)

/* Add `delta` to each row of `residual` in place (unless `delta` is NULL), and write the
 * normalized rows, times `weight`, to `out` (transformers' LlamaRMSNorm).
 *
 * residual: [rows, HIDDEN], contiguous; holds the sums afterwards
 * delta:    [rows, HIDDEN], contiguous, or NULL
 * weight:   [HIDDEN]
 * out:      [rows, HIDDEN], contiguous, not overlapping the others
 */
void twostroke_add_rms_norm(element *restrict residual, const element *restrict delta,
                            const element *restrict weight, float eps, ptrdiff_t rows,
                            element *restrict out) {
#pragma omp parallel for if (rows * HIDDEN >= 2 * PARALLEL_ELEMENTS) schedule(static)
    for (ptrdiff_t r = 0; r < rows; r++) {
        element *restrict x = residual + r * HIDDEN;
        float sum[HIDDEN];
        if (delta != NULL) {
            const element *restrict d = delta + r * HIDDEN;
            for (int i = 0; i < HIDDEN; i++) {
                x[i] = store(load(x[i]) + load(d[i]));
                sum[i] = load(x[i]);
            }
        } else {
            for (int i = 0; i < HIDDEN; i++) sum[i] = load(x[i]);
        }
        float squares = 0.0f;
        for (int i = 0; i < HIDDEN; i++) squares += sum[i] * sum[i];
        const float inverse = 1.0f / sqrtf(squares / (float)HIDDEN + eps);
        element *restrict y = out + r * HIDDEN;
        for (int i = 0; i < HIDDEN; i++) y[i] = store(load(weight[i]) * load(store(sum[i] * inverse)));
    }
}

/* RMSNorm of each query head and each key head of every token, in place, over the head's
 * HEAD_DIM values with the head's weights (transformers' Qwen3RMSNorm on q and k before
 * rotary): the arithmetic of twostroke_add_rms_norm, over a head instead of a row.
 *
 * qkv:      [tokens, (heads + 2 * kv_heads) * HEAD_DIM], rows `qkv_stride` apart: queries,
 *           keys, values (the values are left as they are)
 * q_weight, k_weight: [HEAD_DIM] each
 */
void twostroke_head_rms_norm(element *restrict qkv, ptrdiff_t qkv_stride, ptrdiff_t tokens,
                             ptrdiff_t heads, ptrdiff_t kv_heads,
                             const element *restrict q_weight,
                             const element *restrict k_weight, float eps) {
#pragma omp parallel for if (tokens * (heads + kv_heads) * HEAD_DIM >= PARALLEL_ELEMENTS) \
    schedule(static)
    for (ptrdiff_t t = 0; t < tokens; t++) {
        element *restrict row = qkv + t * qkv_stride;
        for (ptrdiff_t h = 0; h < heads + kv_heads; h++) {
            element *restrict x = row + h * HEAD_DIM;
            const element *restrict weight = h < heads ? q_weight : k_weight;
            float value[HEAD_DIM];
            float squares = 0.0f;
            for (int i = 0; i < HEAD_DIM; i++) {
                value[i] = load(x[i]);
                squares += value[i] * value[i];
            }
            const float inverse = 1.0f / sqrtf(squares / (float)HEAD_DIM + eps);
            for (int i = 0; i < HEAD_DIM; i++)
                x[i] = store(load(weight[i]) * load(store(value[i] * inverse)));
        }
    }
}

/* Rotate one head in place: x * cos + cat(x2, x1) * signed_sin, rounded after each
 * operator as torch's rotate_ is (twostroke.engine.models.layers). */
static inline void rotate_head(element *restrict x, const element *restrict cos,
                               const element *restrict sin) {
    element rolled[HEAD_DIM];
    memcpy(rolled, x + HALF, sizeof(element) * HALF);
    memcpy(rolled + HALF, x, sizeof(element) * HALF);
    for (int i = 0; i < HEAD_DIM; i++) {
        const element turned = store(load(rolled[i]) * load(sin[i]));
        const element kept = store(load(x[i]) * load(cos[i]));
        x[i] = store(load(kept) + load(turned));
    }
}

/* Rotate each token's query and key heads in place and write its keys and values into the
 * layer's cache slots: the key tile of (block b, head h) is [HEAD_DIM, block_size] (element
 * (d, p) at d * block_size + p), the value tile [block_size, HEAD_DIM].
 *
 * qkv:      [tokens, (heads + 2 * kv_heads) * HEAD_DIM], rows `qkv_stride` apart: queries,
 *           keys, values
 * cos, sin: [tokens, HEAD_DIM] each, contiguous (sin with its first half negated)
 * slots:    [tokens], each token's slot, block * block_size + offset
 * keys, values: the layer's key and value tiles, [num_blocks, kv_heads, ...] each, in the
 *           cache's element type (native_element.h's `cached`; rounded once, from the
 *           rotated element, where it differs)
 */
void twostroke_rotate_write(element *restrict qkv, ptrdiff_t qkv_stride, ptrdiff_t tokens,
                            ptrdiff_t heads, ptrdiff_t kv_heads, const element *restrict cos,
                            const element *restrict sin, const int64_t *restrict slots,
                            ptrdiff_t block_size, cached *restrict keys,
                            cached *restrict values) {
#pragma omp parallel for if (tokens * (heads + 2 * kv_heads) * HEAD_DIM >= PARALLEL_ELEMENTS) \
    schedule(static)
    for (ptrdiff_t t = 0; t < tokens; t++) {
        element *restrict row = qkv + t * qkv_stride;
        const element *restrict c = cos + t * HEAD_DIM;
        const element *restrict s = sin + t * HEAD_DIM;
        for (ptrdiff_t h = 0; h < heads + kv_heads; h++) rotate_head(row + h * HEAD_DIM, c, s);
        const ptrdiff_t block = slots[t] / block_size, within = slots[t] % block_size;
        for (ptrdiff_t h = 0; h < kv_heads; h++) {
            const element *restrict k = row + (heads + h) * HEAD_DIM;
            const element *restrict v = row + (heads + kv_heads + h) * HEAD_DIM;
            const ptrdiff_t tile = (block * kv_heads + h) * HEAD_DIM * block_size;
#if CACHE_DIFFERS
            for (int d = 0; d < HEAD_DIM; d++) keys[tile + d * block_size + within] = store_cached(load(k[d]));
            cached *restrict to = values + tile + within * HEAD_DIM;
            for (int d = 0; d < HEAD_DIM; d++) to[d] = store_cached(load(v[d]));
#else
            for (int d = 0; d < HEAD_DIM; d++) keys[tile + d * block_size + within] = k[d];
            memcpy(values + tile + within * HEAD_DIM, v, sizeof(element) * HEAD_DIM);
#endif
        }
    }
}

/* SwiGLU's middle: out = silu(gate) * up, each rounded as torch rounds them.
 *
 * gate_up: [rows, 2 * width], rows `stride` apart: the gate, then the up projection
 * out:     [rows, width], contiguous
 */
void twostroke_silu_mul(const element *restrict gate_up, ptrdiff_t stride, ptrdiff_t rows,
                        ptrdiff_t width, element *restrict out) {
#pragma omp parallel for if (rows * width >= PARALLEL_ELEMENTS) schedule(static)
    for (ptrdiff_t r = 0; r < rows; r++) {
        const element *restrict gate = gate_up + r * stride;
        const element *restrict up = gate + width;
        element *restrict y = out + r * width;
        for (ptrdiff_t i = 0; i < width; i++) {
            const float g = load(gate[i]);
            const element silu = store(g / (1.0f + exp_clamped(-g)));
            y[i] = store(load(silu) * load(up[i]));
        }
    }
}

/* The index of each row's largest value, as torch.argmax takes it: the first of equal
 * maxima, and the first NaN where a row has one (NaN counts as the largest). NaN is found
 * by its bits, which the compiler's finite-math assumption leaves alone. torch's own argmax
 * is a scalar loop on the CPU: 0.7-1.1 ms for a decode step's 32 x 49,152 logits, against
 * a vectorized max of 0.05 ms.
 *
 * logits: [rows, cols] float32, rows `stride` apart
 * out:    [rows] int64
 */
void twostroke_argmax(const float *restrict logits, ptrdiff_t rows, ptrdiff_t cols,
                      ptrdiff_t stride, int64_t *restrict out) {
#pragma omp parallel for if (rows * cols >= 16 * PARALLEL_ELEMENTS) schedule(static)
    for (ptrdiff_t r = 0; r < rows; r++) {
        const float *restrict x = logits + r * stride;
        float top = x[0];
        uint32_t nan = 0;
        for (ptrdiff_t i = 0; i < cols; i++) {
            uint32_t bits;
            memcpy(&bits, x + i, sizeof bits);
            nan |= (bits & 0x7fffffffu) > 0x7f800000u;
            top = x[i] > top ? x[i] : top;
        }
        ptrdiff_t found = 0;
        for (ptrdiff_t i = 0; i < cols; i++) {
            uint32_t bits;
            memcpy(&bits, x + i, sizeof bits);
            if (nan ? (bits & 0x7fffffffu) > 0x7f800000u : x[i] == top) {
                found = i;
                break;
            }
        }
        out[r] = (int64_t)found;
    }
}
