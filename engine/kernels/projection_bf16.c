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
#define _GNU_SOURCE /* syscall() */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PROJECTION_SUPPORTED 1
#else
#define PROJECTION_SUPPORTED 0
#endif

/* AMX's bfloat16 tiles: compiled where the compiler targets them (-march=native on a CPU
 * with AMX-BF16; no personality's rung does), used once Linux grants the tile state. */
#if PROJECTION_SUPPORTED && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define TILES_BUILT 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define TILES_BUILT 0
#endif

#define LANES 16          /* float32 sums in one 512-bit register */
#define COLUMN_VECTORS 3  /* registers of sums across a panel */
#define PANEL (LANES * COLUMN_VECTORS)
#define ROWS 8            /* rows in a tile: ROWS * COLUMN_VECTORS = 24 of 32 registers */
_Static_assert(ROWS == 8, "twostroke_projection's switch takes tiles of 1 to 8 rows");

/*
 * Pairs of inputs ahead of the one a tile multiplies whose panel rows it asks the cache for
 * (6 KiB ahead). This guest's own prefetching left a decode step's projections waiting on
 * memory: one decode of SmolLM2, 2 threads, Intel Xeon with AMX (`twostroke profile-step
 * --dtype auto --batch 1`, alternated runs) took 18.6-19.5 ms a step without the hints and
 * 14.9-15.1 with them; 16, 32 and 64 pairs ahead were alike within the machine's noise.
 */
#define PREFETCH_PAIRS 32

/* Multiply-adds below which one thread does the whole call (the team's wake-up costs more). */
#define PARALLEL_WORK (1 << 18)

int twostroke_projection_supported(void) { return PROJECTION_SUPPORTED; }

int twostroke_projection_panel(void) { return PANEL; }

/*
 * Whether twostroke_projection_tiled() may multiply on AMX tiles: built for them, and Linux
 * grants this process the tiles' state (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA, which a process asks for once, for all its threads; oneDNN asks the
 * same). Without the grant a tile instruction would kill the process, so the caller asks
 * before it binds twostroke_projection_tiled(), and binds twostroke_projection() on 0.
 */
int twostroke_projection_tiles(void) {
#if TILES_BUILT
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#else
    return 0;
#endif
}

#if PROJECTION_SUPPORTED
#include <immintrin.h>

/* Which of panel q's columns, COLUMN_VECTORS vectors of LANES, are outputs (the panels are
 * zero past out_features, and nothing is stored there). */
static inline void panel_masks(ptrdiff_t q, ptrdiff_t out_features,
                               __mmask16 masks[COLUMN_VECTORS]) {
    for (int v = 0; v < COLUMN_VECTORS; v++) {
        ptrdiff_t left = out_features - q * PANEL - v * LANES;
        masks[v] = left >= LANES ? (__mmask16)0xFFFF
                   : left <= 0   ? (__mmask16)0
                                 : (__mmask16)((1u << left) - 1);
    }
}

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
        /* Past the panel's end this is the next panel's start (a hint never faults). */
        for (int v = 0; v < COLUMN_VECTORS; v++)
            _mm_prefetch((const char *)(panel + ((p + PREFETCH_PAIRS) * PANEL + v * LANES) * 2),
                         _MM_HINT_T0);
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
        panel_masks(q, out_features, masks);
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

/*
 * AMX: TDPBF16PS multiplies a tile of TILE_ROWS rows by TILE_PAIRS pairs of inputs (A, 64
 * bytes a row) by one of TILE_PAIRS pairs by 16 columns (B, each row a pair for 16 columns:
 * the panels' own layout, a row PANEL * 2 elements from the next), into TILE_ROWS by 16
 * float32 sums (C). Tiles 0-2 hold the sums of a row tile by the panel's 3 column tiles, 3
 * the rows' inputs, 4-6 the panel's weights. The panel is read from memory once a call, as
 * by the vector tiles above, and from the cache for each later row tile.
 */
#define TILE_ROWS 16
#define TILE_PAIRS 16
/* Steps (TILE_PAIRS pairs each) ahead whose panel rows amx_tile() asks the cache for, as
 * the vector tiles do: at 16 and 32 rows on 30 layers' weights the tiles took 0.82-0.90 of
 * their time without the hints (alternated runs; 1, 2 and 4 steps ahead were alike). */
#define PREFETCH_STEPS 2
/* Every row count runs on the tiles, one row included, though the vector tiles were faster
 * below 5 rows (their time over the AMX tiles' 0.89-0.94 at 1 row, 0.90-0.93 at 4, 1.08 at
 * 5: SmolLM2's four projections of a layer, 30 layers' weights in turn, 2 threads, Intel
 * Xeon with AMX): the two sum in different orders, so a row's outputs would change with
 * the rows beside it, and greedy tokens with the batch (speculative decoding's check that
 * drafts leave them unchanged failed). A row's sums on the tiles do not depend on the
 * others; one decode step costs 13.4 -> 14.7 ms for it (medians of three, alternated). */
_Static_assert(PANEL == 3 * 16, "a panel is three AMX column tiles");

#if TILES_BUILT
struct tile_config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t columns[16]; /* bytes a row of each tile */
    uint8_t rows[16];
};

/* `rows` rows of a (a_stride apart) by one panel: a tile's rows as configured (TILE_ROWS,
 * or all there are where they are fewer); a last part of more is copied into zeroed rows. */
static void amx_tile(const uint16_t *a, ptrdiff_t a_stride, ptrdiff_t rows,
                     const uint16_t *panel, ptrdiff_t steps, const float *bias,
                     __mmask16 const *masks, uint16_t *out, ptrdiff_t out_stride) {
    const ptrdiff_t b_stride = PANEL * 2 * (ptrdiff_t)sizeof(uint16_t);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (ptrdiff_t k = 0; k < steps; k++) {
        const uint16_t *b = panel + k * TILE_PAIRS * PANEL * 2;
        if (k + PREFETCH_STEPS < steps) { /* a step's 3 KiB of the panel, 48 lines */
            const char *next = (const char *)(b + PREFETCH_STEPS * TILE_PAIRS * PANEL * 2);
            for (int line = 0; line < TILE_PAIRS * PANEL * 2 * 2 / 64; line++)
                _mm_prefetch(next + 64 * line, _MM_HINT_T0);
        }
        _tile_loadd(3, a + k * 2 * TILE_PAIRS, a_stride * (ptrdiff_t)sizeof(uint16_t));
        _tile_loadd(4, b, b_stride);
        _tile_loadd(5, b + 16 * 2, b_stride);
        _tile_loadd(6, b + 32 * 2, b_stride);
        _tile_dpbf16ps(0, 3, 4);
        _tile_dpbf16ps(1, 3, 5);
        _tile_dpbf16ps(2, 3, 6);
    }
    float sums[TILE_ROWS][PANEL];
    _tile_stored(0, &sums[0][0], PANEL * (ptrdiff_t)sizeof(float));
    _tile_stored(1, &sums[0][16], PANEL * (ptrdiff_t)sizeof(float));
    _tile_stored(2, &sums[0][32], PANEL * (ptrdiff_t)sizeof(float));
    for (ptrdiff_t r = 0; r < rows; r++)
        for (int v = 0; v < COLUMN_VECTORS; v++) {
            __m512 sum = _mm512_loadu_ps(&sums[r][v * LANES]);
            if (bias)
                sum = _mm512_add_ps(sum, _mm512_loadu_ps(bias + v * LANES));
            __m256i rounded = (__m256i)_mm512_cvtneps_pbh(sum);
            _mm256_mask_storeu_epi16(out + r * out_stride + v * LANES, masks[v], rounded);
        }
}
#endif

/*
 * twostroke_projection() (the same arguments and result), on AMX tiles where in_features is
 * a whole number of tiles' inputs (2 * TILE_PAIRS); else, or built without the tiles, the
 * vector tiles (each weight's products by one path: see above). Bound only where
 * twostroke_projection_tiles() returned 1. The sums are float32, as the vector tiles', in
 * another order (subnormal inputs count as zero), and each output is rounded to bfloat16
 * once, as there. Fewer rows than a tile are a tile of that many rows; more, whole tiles,
 * and a last part is copied into zeroed memory (returns 2 where it could not be allocated).
 */
int twostroke_projection_tiled(
    const uint16_t *x, ptrdiff_t x_stride, ptrdiff_t rows, ptrdiff_t in_features,
    const void *weight, ptrdiff_t out_features, const float *bias, uint16_t *out,
    ptrdiff_t out_stride)
{
#if TILES_BUILT
    if (rows > 0 && in_features % (2 * TILE_PAIRS) == 0) { /* (a tile of 0 rows is invalid) */
        const uint16_t *panels = (const uint16_t *)weight;
        ptrdiff_t count = (out_features + PANEL - 1) / PANEL, steps = in_features / (2 * TILE_PAIRS);
        /* Fewer rows than a tile: the tiles are configured to the rows there are. */
        int few = rows < TILE_ROWS;
        ptrdiff_t whole = few ? rows : rows / TILE_ROWS * TILE_ROWS, left = rows - whole;
        uint16_t *last = NULL;
        if (left) {
            last = calloc((size_t)(TILE_ROWS * in_features), sizeof *last);
            if (!last)
                return 2;
            for (ptrdiff_t r = 0; r < left; r++)
                memcpy(last + r * in_features, x + (whole + r) * x_stride,
                       (size_t)in_features * sizeof *last);
        }
        int parallel = count > 1 && rows * in_features * out_features >= PARALLEL_WORK;
#pragma omp parallel if (parallel)
        {
            struct tile_config config = {.palette = 1};
            for (int t = 0; t < 7; t++) {
                config.rows[t] = (uint8_t)(t < 4 && few ? rows : TILE_ROWS); /* C, A; B */
                config.columns[t] = 64;
            }
            _tile_loadconfig(&config);
#pragma omp for schedule(static)
            for (ptrdiff_t q = 0; q < count; q++) {
                const uint16_t *panel = panels + q * in_features * PANEL;
                const float *panel_bias = bias ? bias + q * PANEL : NULL;
                __mmask16 masks[COLUMN_VECTORS];
                panel_masks(q, out_features, masks);
                for (ptrdiff_t r0 = 0; r0 < rows; r0 += TILE_ROWS) {
                    int whole_tile = r0 < whole;
                    amx_tile(whole_tile ? x + r0 * x_stride : last,
                             whole_tile ? x_stride : in_features,
                             rows - r0 < TILE_ROWS ? rows - r0 : TILE_ROWS, panel, steps,
                             panel_bias, masks, out + r0 * out_stride + q * PANEL, out_stride);
                }
            }
            _tile_release();
        }
        free(last);
        return 0;
    }
#endif
    return twostroke_projection(x, x_stride, rows, in_features, weight, out_features, bias, out,
                                out_stride);
}
#endif
