/* Every function twostroke's compiled CPU kernels export, and the structures the decoder
 * stack takes, declared once.
 *
 * Each kernel's source includes this file, so the compiler holds its definitions to these
 * declarations (a definition that differs does not compile). The Python side reads the same
 * file (twostroke.engine.kernels.header parses the small subset of C written here: function
 * types, one `twostroke_*_fn` typedef each, and structures of scalar and pointer fields),
 * so each binding's argument types and the stack's ctypes structures come from here too;
 * twostroke.engine.kernels.stack compiles a probe of these structures' layout and refuses
 * the library where ctypes lays them out otherwise. A mismatch fails the build, which the
 * fallback to torch's operators covers, never a call.
 *
 * Tensors are `element` (native_element.h: float, or bfloat16 bits with -DELEMENT_BF16),
 * the KV cache `cached` (the same type unless -DCACHE_F32, -DCACHE_F16 or -DCACHE_BF16);
 * the bfloat16 projection takes bfloat16 bits and the block products float32 whatever the
 * build, and the stack is built for the element type of the kernels it drives: with
 * -DELEMENT_BF16 for the bfloat16 projections, without for the GGUF blocks' (it never
 * touches the cache's elements, so one build serves every cache type).
 */
#ifndef TWOSTROKE_KERNELS_H
#define TWOSTROKE_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "native_element.h"

/* Every library: the widest vectors its code uses (native_element.h). */
typedef int twostroke_vector_bits_fn(void);
twostroke_vector_bits_fn twostroke_vector_bits;

/* decoder_glue.c: the element-wise glue between the matrix products. */
typedef void twostroke_add_rms_norm_fn(element *residual, const element *delta,
                                       const element *weight, float eps, ptrdiff_t rows,
                                       element *out);
typedef void twostroke_rotate_write_fn(element *qkv, ptrdiff_t qkv_stride, ptrdiff_t tokens,
                                       ptrdiff_t heads, ptrdiff_t kv_heads, const element *cos,
                                       const element *sin, const int64_t *slots,
                                       ptrdiff_t block_size, cached *keys, cached *values);
typedef void twostroke_head_rms_norm_fn(element *qkv, ptrdiff_t qkv_stride, ptrdiff_t tokens,
                                        ptrdiff_t heads, ptrdiff_t kv_heads,
                                        const element *q_weight, const element *k_weight,
                                        float eps);
typedef void twostroke_silu_mul_fn(const element *gate_up, ptrdiff_t stride, ptrdiff_t rows,
                                   ptrdiff_t width, element *out);
typedef void twostroke_argmax_fn(const float *logits, ptrdiff_t rows, ptrdiff_t cols,
                                 ptrdiff_t stride, int64_t *out);
twostroke_add_rms_norm_fn twostroke_add_rms_norm;
twostroke_rotate_write_fn twostroke_rotate_write;
twostroke_head_rms_norm_fn twostroke_head_rms_norm;
twostroke_silu_mul_fn twostroke_silu_mul;
twostroke_argmax_fn twostroke_argmax;

/* paged_decode.c: attention over the paged cache, read in place. */
typedef int twostroke_paged_decode_fn(const element *query, ptrdiff_t query_stride,
                                      const cached *keys, const cached *values,
                                      const int32_t *tables, ptrdiff_t table_stride,
                                      const int32_t *lengths, ptrdiff_t decodes,
                                      ptrdiff_t kv_heads, float scale, ptrdiff_t window,
                                      element *out);
typedef int twostroke_paged_prefill_fn(const element *query, ptrdiff_t query_stride,
                                       const cached *keys, const cached *values,
                                       const int32_t *tables, ptrdiff_t table_stride,
                                       const int32_t *starts, const int32_t *counts,
                                       const int32_t *offsets, ptrdiff_t chunks,
                                       ptrdiff_t kv_heads, float scale, ptrdiff_t window,
                                       element *out, ptrdiff_t out_stride);
twostroke_paged_decode_fn twostroke_paged_decode;
twostroke_paged_prefill_fn twostroke_paged_prefill;

/* The projections the decoder stack calls: out = x W^T + bias (bias float32 or NULL), where
 * `weight` is W in the kernel's own form. Returns 0, or nonzero where it could not allocate
 * its scratch memory (nothing meaningful is written then). The bfloat16 projection below is
 * one where element is bfloat16, the GGUF blocks' one where it is float. */
typedef int twostroke_stack_projection_fn(const element *x, ptrdiff_t x_stride, ptrdiff_t rows,
                                          ptrdiff_t in_features, const void *weight,
                                          ptrdiff_t out_features, const float *bias,
                                          element *out, ptrdiff_t out_stride);

/* projection_bf16.c: the bfloat16 projections (defined where the CPU has AVX512-BF16);
 * `weight` is the panels. twostroke_projection_tiled takes many rows on AMX tiles, where
 * twostroke_projection_tiles() has said they may be used. */
typedef int twostroke_projection_supported_fn(void);
typedef int twostroke_projection_panel_fn(void);
typedef int twostroke_projection_tiles_fn(void);
typedef int twostroke_projection_fn(const uint16_t *x, ptrdiff_t x_stride, ptrdiff_t rows,
                                    ptrdiff_t in_features, const void *weight,
                                    ptrdiff_t out_features, const float *bias, uint16_t *out,
                                    ptrdiff_t out_stride);
twostroke_projection_supported_fn twostroke_projection_supported;
twostroke_projection_panel_fn twostroke_projection_panel;
twostroke_projection_tiles_fn twostroke_projection_tiles;
typedef int twostroke_projection_tiled_fn(const uint16_t *x, ptrdiff_t x_stride, ptrdiff_t rows,
                                          ptrdiff_t in_features, const void *weight,
                                          ptrdiff_t out_features, const float *bias,
                                          uint16_t *out, ptrdiff_t out_stride);
twostroke_projection_fn twostroke_projection;
twostroke_projection_tiled_fn twostroke_projection_tiled;

/* gguf_blocks.c: products by GGUF's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K blocks
 * as stored (`type` is GGML's type number), of activations quantized per block of 32 or as they
 * are (twostroke_block_linear_float); and the rows of
 * such a weight. */
struct twostroke_block_part {
    int type;               /* GGML's type number */
    ptrdiff_t out_features; /* its weight rows */
    const void *blocks;     /* [out_features][in_features / 32 (K types: 256)] blocks */
    const int32_t *columns; /* [out_features]: each row's output column, or NULL: its own */
    ptrdiff_t offset;       /* its first output column */
};
typedef int twostroke_blocks_path_fn(void);
typedef void twostroke_quantize_rows_fn(const float *x, ptrdiff_t x_stride, ptrdiff_t rows,
                                        ptrdiff_t in_features, int8_t *q, float *scales,
                                        float *sums);
typedef int twostroke_block_linear_fn(const float *x, ptrdiff_t x_stride, ptrdiff_t rows,
                                      ptrdiff_t in_features,
                                      const struct twostroke_block_part *parts, ptrdiff_t count,
                                      float *out, ptrdiff_t out_stride);
typedef int twostroke_block_linear_float_fn(const float *x, ptrdiff_t x_stride, ptrdiff_t rows,
                                            ptrdiff_t in_features,
                                            const struct twostroke_block_part *parts,
                                            ptrdiff_t count, float *out, ptrdiff_t out_stride);
typedef int twostroke_block_rows_fn(int type, const void *blocks, ptrdiff_t in_features,
                                    const int64_t *ids, ptrdiff_t count, float *out);
/* The same rows rounded to bfloat16 bits (to nearest even, as torch rounds): the dense
 * path's weights where it multiplies in bfloat16. Returns 0, 1 for a type it does not
 * compute, 2 where it could not allocate a row's scratch. */
typedef int twostroke_block_rows_bf16_fn(int type, const void *blocks, ptrdiff_t in_features,
                                         const int64_t *ids, ptrdiff_t count, uint16_t *out);
/* A projection's parts, as the decoder stack passes one (`weight`) to
 * twostroke_block_projection, a twostroke_stack_projection_fn where element is float. */
struct twostroke_block_weight {
    const struct twostroke_block_part *parts; /* [count] */
    ptrdiff_t count;
    int float_activations; /* 0: quantized per block (twostroke_block_linear); 1: as they are */
};
typedef int twostroke_block_projection_fn(const float *x, ptrdiff_t x_stride, ptrdiff_t rows,
                                          ptrdiff_t in_features, const void *weight,
                                          ptrdiff_t out_features, const float *bias,
                                          float *out, ptrdiff_t out_stride);
twostroke_blocks_path_fn twostroke_blocks_path;
twostroke_quantize_rows_fn twostroke_quantize_rows;
twostroke_block_linear_fn twostroke_block_linear;
twostroke_block_linear_float_fn twostroke_block_linear_float;
twostroke_block_rows_fn twostroke_block_rows;
twostroke_block_rows_bf16_fn twostroke_block_rows_bf16;
twostroke_block_projection_fn twostroke_block_projection;

/* decoder_stack.c: the model, its kernels and each layer's weights (fixed once loaded). */
struct twostroke_layer {
    const void *input_norm, *post_norm; /* [hidden] */
    float input_eps, post_eps;
    /* The four projections' weights in the stack's projection's form, and their float32
     * biases (or NULL). */
    const void *qkv, *o, *gate_up, *down;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
    ptrdiff_t window; /* the attention's sliding window (paged_decode.c); 0: none */
    /* Each query head's and key head's RMSNorm weights ([head_dim] each) and epsilon,
     * applied before rotary (Qwen3); NULL: none. */
    const void *q_norm, *k_norm;
    float qk_eps;
};

struct twostroke_model {
    ptrdiff_t layers, hidden, intermediate, heads, kv_heads, head_dim;
    float scale;
    twostroke_add_rms_norm_fn *norm;
    twostroke_stack_projection_fn *projection;
    twostroke_rotate_write_fn *rotate;
    twostroke_silu_mul_fn *silu;
    twostroke_head_rms_norm_fn *head_norm;
    const struct twostroke_layer *layer; /* [layers] */
};

/* One step: its tokens, their attention's layout, the cache and the scratch rows. */
struct twostroke_step {
    ptrdiff_t tokens;
    void *residual;        /* [tokens, hidden], the embeddings; holds the stream after */
    const void *cos, *sin; /* [tokens, head_dim] each */
    const int64_t *slots;  /* [tokens] */
    ptrdiff_t block_size;
    void *const *keys;   /* [layers]: each layer's key tiles */
    void *const *values; /* [layers]: each layer's value tiles */
    /* Attention: decodes only (prefill == NULL) or chunks (decode == NULL). */
    twostroke_paged_decode_fn *decode;
    twostroke_paged_prefill_fn *prefill;
    const int32_t *tables;
    ptrdiff_t table_stride;
    const int32_t *lengths;                   /* decodes: [tokens] */
    const int32_t *starts, *counts, *offsets; /* chunks: [chunks] each */
    ptrdiff_t chunks;
    /* Scratch, each rows of `tokens`: normed [hidden], qkv [(heads + 2 kv_heads) head_dim],
     * attended [heads head_dim], projected [hidden], gate_up [2 intermediate],
     * mixed [intermediate]; and delta [hidden], the last layer's MLP output after. */
    void *normed, *qkv, *attended, *projected, *gate_up, *mixed, *delta;
};

/* Run every layer. Returns 0, or 1 if an attention kernel or a projection could not
 * allocate its scratch memory (the step's results are then garbage, and the caller raises). */
typedef int twostroke_decoder_stack_fn(const struct twostroke_model *m,
                                       const struct twostroke_step *s);
twostroke_decoder_stack_fn twostroke_decoder_stack;

/* The probe twostroke.engine.kernels.stack generates from these structures and builds: each
 * structure's size, then each of its fields' offsets, in order, into `out`. */
typedef void twostroke_layout_fn(ptrdiff_t *out);
twostroke_layout_fn twostroke_layout;

#endif
