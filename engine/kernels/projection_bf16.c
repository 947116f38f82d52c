/*
 * The decoder's projections, y = x W^T (+ b), in bfloat16 with float32 sums, on CPUs with
 * AVX512-BF16 (its VDPBF16PS multiplies pairs of bfloat16 and adds them into float32).
 *
 * twostroke.engine.kernels.projection compiles this file at run time with the
 * machine's C compiler and caches the library (see build.py); that module's docstring
 * says why and what was measured. Built for a CPU without AVX512-BF16, the library says so
 * (twostroke_projection_supported() returns 0) and has no kernel: the model keeps oneDNN's.
 *
 * The weight is laid out once, at load, in panels of PANEL output columns:
 *
 *     panels[panel][pair][column][2] = W[panel * PANEL + column][2 * pair + {0, 1}]
 *
 * (zero where the column is past out_features), so one vector load takes two inputs' weights
 * for LANES columns, which is what VDPBF16PS multiplies by a broadcast pair of one row's
 * inputs. A tile of ROWS rows by one panel keeps its ROWS * COLUMN_VECTORS float32 sums in
 * registers over the whole input width: the panel's weights are read from memory once for
 * the first ROWS rows and from the cache for the rest (a panel is in_features * PANEL * 2
 * bytes: 55 KiB for a width of 576). The thread team splits the panels, so each weight is
 * read by one thread, from memory, once a call.
 */
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PROJECTION_SUPPORTED 1
#else
#define PROJECTION_SUPPORTED 0
#endif

#define LANES 16          /* float32 sums in one 512-bit register */
#define COLUMN_VECTORS 3  /* registers of sums across a panel */
#define PANEL (LANES * COLUMN_VECTORS)
#define ROWS 8            /* rows in a tile: ROWS * COLUMN_VECTORS = 24 of 32 registers */
_Static_assert(ROWS == 8, "twostroke_projection's switch takes tiles of 1 to 8 rows");

/* Multiply-adds below which one thread does the whole call (the team's wake-up costs more). */
#define PARALLEL_WORK (1 << 18)

int twostroke_projection_supported(void) { return PROJECTION_SUPPORTED; }

int twostroke_projection_panel(void) { return PANEL; }

#if PROJECTION_SUPPORTED
#include <immintrin.h>

/* One tile: `rows` (1..ROWS, a constant where this is inlined) rows of x by one panel. */
static inline __attribute__((always_inline)) void tile(
    int rows, const uint16_t *x, ptrdiff_t x_stride, const uint16_t *panel, ptrdiff_t pairs,
    const float *bias, __mmask16 const *masks, uint16_t *out, ptrdiff_t out_stride)
{
    __m512 sums[ROWS][COLUMN_VECTORS];
    for (int v = 0; v < COLUMN_VECTORS; v++) {
        __m512 start = bias ? _mm512_loadu_ps(bias + v * LANES) : _mm512_setzero_ps();
        for (int r = 0; r < ROWS; r++)
            sums[r][v] = start;
    }
    for (ptrdiff_t p = 0; p < pairs; p++) {
        __m512bh weights[COLUMN_VECTORS];
        for (int v = 0; v < COLUMN_VECTORS; v++)
            weights[v] = (__m512bh)_mm512_loadu_si512(panel + (p * PANEL + v * LANES) * 2);
        for (int r = 0; r < ROWS; r++) {
            if (r < rows) {
                uint32_t pair;
                __builtin_memcpy(&pair, x + r * x_stride + 2 * p, sizeof pair);
                __m512bh inputs = (__m512bh)_mm512_set1_epi32((int)pair);
                for (int v = 0; v < COLUMN_VECTORS; v++)
                    sums[r][v] = _mm512_dpbf16_ps(sums[r][v], inputs, weights[v]);
            }
        }
    }
    for (int r = 0; r < ROWS; r++) {
        if (r < rows) {
            for (int v = 0; v < COLUMN_VECTORS; v++) {
                /* Rounded to nearest even, as torch rounds float32 to bfloat16. */
                __m256i rounded = (__m256i)_mm512_cvtneps_pbh(sums[r][v]);
                _mm256_mask_storeu_epi16(out + r * out_stride + v * LANES, masks[v], rounded);
            }
        }
    }
}

/*
 * out[rows][out_features] (row stride out_stride) = x W^T + bias.
 *
 * x: bfloat16 [rows][in_features], row stride x_stride, in_features even.
 * weight: the panels, the weight in the layout above, ceil(out_features / PANEL) of them.
 * bias: float32, ceil(out_features / PANEL) * PANEL of them (zero past out_features), or NULL.
 * Returns 0 (the stack's projections return whether they failed: this one cannot).
 */
int twostroke_projection(
    const uint16_t *x, ptrdiff_t x_stride, ptrdiff_t rows, ptrdiff_t in_features,
    const void *weight, ptrdiff_t out_features, const float *bias, uint16_t *out,
    ptrdiff_t out_stride)
{
    const uint16_t *panels = (const uint16_t *)weight;
    ptrdiff_t count = (out_features + PANEL - 1) / PANEL, pairs = in_features / 2;
    int parallel = count > 1 && rows * in_features * out_features >= PARALLEL_WORK;
#pragma omp parallel for if (parallel) schedule(static)
    for (ptrdiff_t q = 0; q < count; q++) {
        const uint16_t *panel = panels + q * in_features * PANEL;
        const float *panel_bias = bias ? bias + q * PANEL : NULL;
        __mmask16 masks[COLUMN_VECTORS];
        for (int v = 0; v < COLUMN_VECTORS; v++) {
            ptrdiff_t left = out_features - q * PANEL - v * LANES;
            masks[v] = left >= LANES ? (__mmask16)0xFFFF
                       : left <= 0   ? (__mmask16)0
                                     : (__mmask16)((1u << left) - 1);
        }
        for (ptrdiff_t r0 = 0; r0 < rows; r0 += ROWS) {
            const uint16_t *xr = x + r0 * x_stride;
            uint16_t *o = out + r0 * out_stride + q * PANEL;
            switch (rows - r0 < ROWS ? (int)(rows - r0) : ROWS) {
            case 8: tile(8, xr, x_stride, panel, pairs, panel_bias, masks, o, out_stride); break;
            case 7: tile(7, xr, x_stride, panel, pairs, panel_bias, masks, o, out_stride); break;
            case 6: tile(6, xr, x_stride, panel, pairs, panel_bias, masks, o, out_stride); break;
            case 5: tile(5, xr, x_stride, panel, pairs, panel_bias, masks, o, out_stride); break;
            case 4: tile(4, xr, x_stride, panel, pairs, panel_bias, masks, o, out_stride); break;
            case 3: tile(3, xr, x_stride, panel, pairs, panel_bias, masks, o, out_stride); break;
            case 2: tile(2, xr, x_stride, panel, pairs, panel_bias, masks, o, out_stride); break;
            default: tile(1, xr, x_stride, panel, pairs, panel_bias, masks, o, out_stride); break;
            }
        }
    }
    return 0;
}
#endif
