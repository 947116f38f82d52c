/* The decoder's residual add and RMSNorm on the CPU, in one pass over each row.
 *
 * twostroke.engine.models.native_norm compiles this file at run time with the machine's C
 * compiler, once per width and element type, and caches the library (see
 * twostroke.engine.models.native):
 *
 *   -DHIDDEN=576      the width of a row (the model's hidden size)
 *   -DELEMENT_BF16    bfloat16 rows and weight (else float; see native_element.h)
 *
 * A pre-norm decoder layer adds each block's output to the residual stream and normalizes
 * the sum for the next block. torch does that in five operators or more per norm
 * (``rms_norm`` is not one kernel on the CPU, and in bfloat16 two casts come with it), each
 * a pass over the rows and a call from Python. Here it is one call per norm, one pass.
 *
 * The arithmetic is transformers' (modeling_llama's LlamaRMSNorm) in float32, whatever the
 * element type: the sum is rounded to the element type first (as ``x + delta`` is), the
 * mean of its squares taken in float32, the row multiplied by ``1 / sqrt(mean + eps)``,
 * rounded to the element type, and multiplied by the weight. Only the order of the mean's
 * sum differs from torch's, so results agree to float32 rounding.
 */
#include <math.h>
#include <stddef.h>

#include "native_element.h"

#ifndef HIDDEN
#error "compile with -DHIDDEN="
#endif

/* Below this many rows the call stays on the calling thread: a decode step's rows take
 * microseconds, less than waking the thread team. */
#define PARALLEL_ROWS 64

/* Add `delta` to each row of `residual` in place (unless `delta` is NULL), and write the
 * normalized rows, times `weight`, to `out`.
 *
 * residual: [rows, HIDDEN], contiguous; holds the sums afterwards
 * delta:    [rows, HIDDEN], contiguous, or NULL
 * weight:   [HIDDEN]
 * out:      [rows, HIDDEN], contiguous, not overlapping the others
 */
void twostroke_add_rms_norm(element *restrict residual, const element *restrict delta,
                            const element *restrict weight, float eps, ptrdiff_t rows,
                            element *restrict out) {
#pragma omp parallel for if (rows >= PARALLEL_ROWS) schedule(static)
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
