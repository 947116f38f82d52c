/*
 * One step's decoder layers in one call: the compiled kernels of the other three sources,
 * called in the order LlamaForCausalLM.forward calls them from Python, with nothing between.
 *
 * twostroke.engine.kernels.stack compiles this file at run time with the machine's C
 * compiler and caches the library (see native.py). It does no arithmetic of its own: it
 * takes the kernels as function pointers out of their own libraries (each built with its
 * own shape constants), so its results are theirs bit for bit, and the Python per-layer
 * path is its reference. What it saves is Python: per layer, nine calls through ctypes,
 * their checks and their output tensors, 2.7 ms of a 13 ms step at one decode (measured on
 * SmolLM2 with the bfloat16 kernels, AVX512-BF16); and the whole stack runs without the GIL,
 * which the engine's bookkeeping stroke wants meanwhile.
 *
 * The typedefs below are the kernels' signatures, and must stay those of
 * decoder_glue.c, projection_bf16.c and paged_decode.c.
 */
#include <stddef.h>
#include <stdint.h>

#include "native_element.h"

typedef void (*norm_fn)(void *residual, const void *delta, const void *weight, float eps,
                        ptrdiff_t rows, void *out);
typedef void (*projection_fn)(const void *x, ptrdiff_t x_stride, ptrdiff_t rows,
                              ptrdiff_t in_features, const void *panels,
                              ptrdiff_t out_features, const float *bias, void *out,
                              ptrdiff_t out_stride);
typedef void (*rotate_fn)(void *qkv, ptrdiff_t qkv_stride, ptrdiff_t tokens, ptrdiff_t heads,
                          ptrdiff_t kv_heads, const void *cos, const void *sin,
                          const int64_t *slots, ptrdiff_t block_size, void *keys,
                          void *values);
typedef void (*silu_fn)(const void *gate_up, ptrdiff_t stride, ptrdiff_t rows,
                        ptrdiff_t width, void *out);
typedef int (*decode_fn)(const void *query, ptrdiff_t query_stride, const void *keys,
                         const void *values, const int32_t *tables, ptrdiff_t table_stride,
                         const int32_t *lengths, ptrdiff_t decodes, ptrdiff_t kv_heads,
                         float scale, void *out);
typedef int (*prefill_fn)(const void *query, ptrdiff_t query_stride, const void *keys,
                          const void *values, const int32_t *tables, ptrdiff_t table_stride,
                          const int32_t *starts, const int32_t *counts,
                          const int32_t *offsets, ptrdiff_t chunks, ptrdiff_t kv_heads,
                          float scale, void *out, ptrdiff_t out_stride);

/* The model: its shape, its kernels and each layer's weights (fixed once loaded). */
struct twostroke_layer {
    const void *input_norm, *post_norm; /* [hidden] */
    float input_eps, post_eps;
    /* Panels and float32 biases (or NULL) of the four projections. */
    const void *qkv, *o, *gate_up, *down;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
};

struct twostroke_model {
    ptrdiff_t layers, hidden, intermediate, heads, kv_heads, head_dim;
    float scale;
    norm_fn norm;
    projection_fn projection;
    rotate_fn rotate;
    silu_fn silu;
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
    decode_fn decode;
    prefill_fn prefill;
    const int32_t *tables;
    ptrdiff_t table_stride;
    const int32_t *lengths;                        /* decodes: [tokens] */
    const int32_t *starts, *counts, *offsets;      /* chunks: [chunks] each */
    ptrdiff_t chunks;
    /* Scratch, each rows of `tokens`: normed [hidden], qkv [(heads + 2 kv_heads) head_dim],
     * attended [heads head_dim], projected [hidden], gate_up [2 intermediate],
     * mixed [intermediate]; and delta [hidden], the last layer's MLP output after. */
    void *normed, *qkv, *attended, *projected, *gate_up, *mixed, *delta;
};

/* Run every layer. Returns 0, or 1 if an attention kernel could not allocate its scratch
 * memory (the step's results are then garbage, and the caller raises). */
int twostroke_decoder_stack(const struct twostroke_model *m, const struct twostroke_step *s) {
    const ptrdiff_t t = s->tokens, hidden = m->hidden, inter = m->intermediate;
    const ptrdiff_t attended = m->heads * m->head_dim;
    const ptrdiff_t qkv = attended + 2 * m->kv_heads * m->head_dim;
    for (ptrdiff_t l = 0; l < m->layers; l++) {
        const struct twostroke_layer *w = &m->layer[l];
        m->norm(s->residual, l ? s->delta : NULL, w->input_norm, w->input_eps, t, s->normed);
        m->projection(s->normed, hidden, t, hidden, w->qkv, qkv, w->qkv_bias, s->qkv, qkv);
        m->rotate(s->qkv, qkv, t, m->heads, m->kv_heads, s->cos, s->sin, s->slots,
                  s->block_size, s->keys[l], s->values[l]);
        int failed;
        if (s->prefill == NULL) {
            failed = s->decode(s->qkv, qkv, s->keys[l], s->values[l], s->tables,
                               s->table_stride, s->lengths, t, m->kv_heads, m->scale,
                               s->attended);
        } else {
            failed = s->prefill(s->qkv, qkv, s->keys[l], s->values[l], s->tables,
                                s->table_stride, s->starts, s->counts, s->offsets, s->chunks,
                                m->kv_heads, m->scale, s->attended, attended);
        }
        if (failed) return 1;
        m->projection(s->attended, attended, t, attended, w->o, hidden, w->o_bias,
                      s->projected, hidden);
        m->norm(s->residual, s->projected, w->post_norm, w->post_eps, t, s->normed);
        m->projection(s->normed, hidden, t, hidden, w->gate_up, 2 * inter, w->gate_up_bias,
                      s->gate_up, 2 * inter);
        m->silu(s->gate_up, 2 * inter, t, inter, s->mixed);
        m->projection(s->mixed, inter, t, inter, w->down, hidden, w->down_bias, s->delta,
                      hidden);
    }
    return 0;
}
