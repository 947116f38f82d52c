/*
 * One step's decoder layers in one call: the compiled kernels of the other three sources,
 * called in the order DecoderLayer.forward (twostroke.engine.models.llama) calls them from
 * Python through the compiled glue, with nothing between.
 *
 * twostroke.engine.kernels.stack compiles this file at run time with the machine's C
 * compiler and caches the library (see twostroke.engine.kernels.build). It does no
 * arithmetic of its own: it takes the kernels as function pointers out of their own
 * libraries (each built with its own shape constants), so its results are theirs bit for
 * bit, and the Python per-layer path is its reference. What it saves is Python: per layer,
 * nine calls through ctypes, their checks and their output tensors, 2.7 ms of a 13 ms step at
 * one decode (measured on SmolLM2 with the bfloat16 kernels, AVX512-BF16); and the whole
 * stack runs without the GIL, which the engine's bookkeeping stroke wants meanwhile.
 *
 * The kernels' types and the model and step structures are kernels.h's, the ones their
 * definitions are compiled against; built once for each element type of the kernels it
 * drives (-DELEMENT_BF16 for the bfloat16 projections, float for the GGUF blocks').
 */
#include "kernels.h"

/* Run every layer (see kernels.h). */
int twostroke_decoder_stack(const struct twostroke_model *m, const struct twostroke_step *s) {
    const ptrdiff_t t = s->tokens, hidden = m->hidden, inter = m->intermediate;
    const ptrdiff_t attended = m->heads * m->head_dim;
    const ptrdiff_t qkv = attended + 2 * m->kv_heads * m->head_dim;
    for (ptrdiff_t l = 0; l < m->layers; l++) {
        const struct twostroke_layer *w = &m->layer[l];
        m->norm(s->residual, l ? s->delta : NULL, w->input_norm, w->input_eps, t, s->normed);
        if (m->projection(s->normed, hidden, t, hidden, w->qkv, qkv, w->qkv_bias, s->qkv, qkv))
            return 1;
        if (w->q_norm != NULL)
            m->head_norm(s->qkv, qkv, t, m->heads, m->kv_heads, w->q_norm, w->k_norm,
                         w->qk_eps);
        m->rotate(s->qkv, qkv, t, m->heads, m->kv_heads, s->cos, s->sin, s->slots,
                  s->block_size, s->keys[l], s->values[l]);
        int failed;
        if (s->prefill == NULL) {
            failed = s->decode(s->qkv, qkv, s->keys[l], s->values[l], s->tables,
                               s->table_stride, s->lengths, t, m->kv_heads, m->scale, w->window,
                               s->attended);
        } else {
            failed = s->prefill(s->qkv, qkv, s->keys[l], s->values[l], s->tables,
                                s->table_stride, s->starts, s->counts, s->offsets, s->chunks,
                                m->kv_heads, m->scale, w->window, s->attended, attended);
        }
        if (failed) return 1;
        failed |= m->projection(s->attended, attended, t, attended, w->o, hidden, w->o_bias,
                                s->projected, hidden);
        m->norm(s->residual, s->projected, w->post_norm, w->post_eps, t, s->normed);
        failed |= m->projection(s->normed, hidden, t, hidden, w->gate_up, 2 * inter,
                                w->gate_up_bias, s->gate_up, 2 * inter);
        m->silu(s->gate_up, 2 * inter, t, inter, s->mixed);
        failed |= m->projection(s->mixed, inter, t, inter, w->down, hidden, w->down_bias,
                                s->delta, hidden);
        if (failed) return 1;
    }
    return 0;
}
