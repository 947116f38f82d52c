/* Paged attention on the CPU: each decode's query heads attend over its history, and each
 * prefill chunk's tokens over theirs, read in place from the paged KV cache through the
 * block tables (twostroke_paged_decode, twostroke_paged_prefill at the end of the file).
 *
 * twostroke.engine.kernels.paged_attention has this file compiled at run time with the
 * machine's C compiler, once per shape and element type, and the library cached (see
 * twostroke.engine.kernels.build):
 *
 *   -DBLOCK_SIZE=16 -DHEAD_DIM=64 -DGROUP=3   positions per block, width of a head, and
 *                                             query heads per key/value head
 *   -DELEMENT_BF16                            bfloat16 queries, cache and output (else float;
 *                                             see native_element.h)
 *   -DCACHE_F16, -DCACHE_BF16, -DCACHE_F32    the cache in another type than the queries
 *                                             (kv_cache_dtype): read and widened in place
 *
 * Compile-time sizes let the compiler keep a block's scores and a head's output in vector
 * registers and unroll the inner loops; with run-time sizes the same loops ran 3x slower.
 *
 * The cache layout is the "bag" kernel's (twostroke.engine.attention.ops): one layer is
 * [2, num_blocks, num_kv_heads, ...], keys first. A key tile (block b, head g) is
 * [HEAD_DIM, BLOCK_SIZE], transposed, so a block's scores for one query are a sum over d of
 * query[d] times row d: BLOCK_SIZE lanes wide, no horizontal reduction. A value tile is
 * [BLOCK_SIZE, HEAD_DIM]. The GROUP query heads that share a key/value head are computed
 * together, so each tile is read from memory once, not GROUP times.
 *
 * Work is split over decodes (and a chunk's tokens) with OpenMP. A decode reads its
 * history block by block, every head's tiles of a block together (they are adjacent: one
 * contiguous read per block), and prefetches the next block's while it sums this one, since
 * the block table hides the next address from the hardware's prefetcher. Split over (decode, head) pairs instead, each
 * pair read a third of that per block, and the attention of SmolLM2's batch-32 step took
 * 1.3x longer; so decodes are split by heads only where there are fewer than threads (one
 * request's decode would leave every thread but one idle). The library links the libgomp that torch has already loaded (the same
 * soname), so it runs on torch's own thread team at torch's thread count, on the thread
 * that calls it.
 *
 * Arithmetic: scores, softmax and sums in float32 whatever the element type; exp by a
 * polynomial (relative error about 2e-7) that the compiler vectorizes. No value at or past a
 * token's length is read, and no score there enters a softmax (a last block's scores are
 * computed whole, and those past the length dropped): unwritten slots of a last block
 * cannot leak in.
 *
 * Sliding window: with window w > 0 a token at position p attends to positions
 * (p - w, p] only, w of them counting itself (transformers' sliding_window_overlay,
 * kv_idx > q_idx - sliding_window, as Mistral and Gemma 3 use it). Blocks wholly before
 * the window are not read at all, so they may hold anything (a scheduler may free them);
 * window 0 attends to the whole history.
 */
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if !defined(BLOCK_SIZE) || !defined(HEAD_DIM) || !defined(GROUP)
#error "compile with -DBLOCK_SIZE=, -DHEAD_DIM= and -DGROUP="
#endif

#define TILE ((ptrdiff_t)HEAD_DIM * BLOCK_SIZE)
#define LINE 64

/* The inner loops work on vectors of LANES floats (GCC's and clang's vector extensions),
 * whose arrays the compiler keeps in registers: with plain float arrays GCC 12 spilled one
 * of the three score accumulators to the stack on every step of the sum (a store and a
 * load in each iteration's dependency chain), and the whole kernel ran 4x slower. */
#if defined(__AVX512F__)
#define WIDEST 16
#define REGISTERS 32
#else
#define WIDEST 8
#define REGISTERS 16
#endif
#if BLOCK_SIZE % WIDEST == 0 && HEAD_DIM % WIDEST == 0
#define LANES WIDEST
#elif BLOCK_SIZE % 8 == 0 && HEAD_DIM % 8 == 0
#define LANES 8
#elif BLOCK_SIZE % 4 == 0 && HEAD_DIM % 4 == 0
#define LANES 4
#else
#define LANES 1
#endif
#define KEY_CHUNKS (BLOCK_SIZE / LANES)
#define VALUE_CHUNKS (HEAD_DIM / LANES)
/* Two partial sums per score, over even and odd d, where they fit in half the vector
 * registers: twice the independent FMA chains (with 16-lane vectors, 3 chains become 6).
 * A decode and every token of a chunk sum their scores in this one order: a position's
 * output must not depend on whether it is computed alone or in a chunk (a recomputed
 * preempted request, a verified draft), and with one chain for chunks and two for decodes
 * SmolLM2's greedy answers changed under preemption and drafts. */
#define SPLIT (HEAD_DIM % 2 == 0 && 2 * GROUP * KEY_CHUNKS <= REGISTERS / 2 ? 2 : 1)
/* Query heads whose outputs are summed together: all GROUP where their sums fit in half
 * the vector registers, else one at a time. */
#define OUTPUT_HEADS (GROUP * VALUE_CHUNKS <= REGISTERS / 2 ? GROUP : 1)

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

/* LANES bfloat16 values from p (any alignment) as floats: one instruction where the vector
 * is a register of AVX-512 or AVX2 (GCC 12 made three of the generic conversion, and the
 * AVX2 kernel ran slower than before vectors). The queries' or the cache's elements. */
static inline vec widen_bf16(const uint16_t *p) {
    vec v;
#if LANES == 16 && defined(__AVX512F__)
    const __m512i widened = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif LANES == 8 && defined(__AVX2__)
    const __m256i widened = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    typedef uint16_t narrow __attribute__((vector_size(LANES * sizeof(uint16_t))));
    typedef uint32_t wide __attribute__((vector_size(LANES * sizeof(uint32_t))));
    narrow bits;
    memcpy(&bits, p, sizeof bits);
    const wide widened = __builtin_convertvector(bits, wide) << 16;
#endif
    memcpy(&v, &widened, sizeof v);
    return v;
}

/* LANES elements from p (any alignment) as floats. */
static inline vec load_vec(const element *p) {
#if defined(ELEMENT_BF16)
    return widen_bf16(p);
#else
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
#endif
}

/* LANES cache elements from p as floats: load_vec where the cache is `element`; half
 * precision widens in one F16C instruction a vector where the instruction set has it. */
static inline vec load_cached_vec(const cached *p) {
#if !CACHE_DIFFERS
    return load_vec(p);
#elif defined(CACHE_BF16)
    return widen_bf16(p);
#elif defined(CACHE_F32)
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
#else
    vec v;
#if LANES == 16 && defined(__AVX512F__)
    const __m512 widened = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    memcpy(&v, &widened, sizeof v);
#elif LANES == 8 && defined(__F16C__)
    const __m256 widened = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    memcpy(&v, &widened, sizeof v);
#else
    for (int l = 0; l < LANES; l++) v[l] = load_cached(p[l]);
#endif
    return v;
#endif
}

/* Into L2 (prefetcht1), not L1: on a Zen 4 EPYC the 30 layers' decode attention of a batch of
 * 32 (histories 90-312, blocks in random order, 147 MB from memory) took 12.7 ms prefetching
 * into L1 and 8.4 ms into L2 (8.1-8.4 ms fetching 1 to 6 blocks ahead; blocks in order 12.0 ->
 * 10.1 ms; from L3, 3.8 -> 3.7 ms), and 10.2 -> 9.7 ms inside SmolLM2's decode step; on
 * Zen 5 the two were alike. */
static inline void prefetch_tile(const cached *tile) {
    const char *bytes = (const char *)tile;
    for (size_t at = 0; at < sizeof(cached) * TILE; at += LINE) __builtin_prefetch(bytes + at, 0, 2);
}

/* Floats of a head's scores row for a token attending to `length` positions: its blocks,
 * rounded up to whole cache lines (see attend). */
static inline ptrdiff_t scores_stride(int32_t length) {
    const ptrdiff_t floats = ((ptrdiff_t)length + BLOCK_SIZE - 1) / BLOCK_SIZE * BLOCK_SIZE;
    const ptrdiff_t line = LINE / (ptrdiff_t)sizeof(float);
    return (floats + line - 1) / line * line;
}

/* Floats of the scaled queries at the start of a thread's scratch, in whole cache lines. */
static inline ptrdiff_t queries_size(ptrdiff_t kv_heads) {
    const ptrdiff_t line = LINE / (ptrdiff_t)sizeof(float);
    return (kv_heads * GROUP * HEAD_DIM + line - 1) / line * line;
}

/* A thread's scratch for tokens attending to at most `longest` positions: the scaled
 * queries, then every query head's scores row; line-aligned. NULL if it cannot be had. */
static float *scratch_for(ptrdiff_t kv_heads, int32_t longest) {
    const size_t floats = (size_t)(queries_size(kv_heads) + kv_heads * GROUP * scores_stride(longest));
    return aligned_alloc(LINE, floats * sizeof(float));
}

/* The first position a token attending up to `length` (exclusive) sees under `window`
 * (0: no window, see the top of this file). */
static inline int32_t window_start(int32_t length, ptrdiff_t window) {
    return window > 0 && length > window ? (int32_t)(length - window) : 0;
}

/* One query token, key/value heads g0 to g1 - 1 (and their query heads), over positions
 * begin to length - 1 (its window; its whole history where begin is 0): block by block,
 * those heads' tiles of a block together (they are adjacent in memory), so each block is
 * one contiguous read.
 *
 * Every token goes through this one compiled body, a decode's and each token of a prefill
 * chunk's alike (noinline: no caller gets a copy of its own to optimize apart), so a
 * position's output does not depend on whether it is computed alone or in a chunk: a
 * recomputed preempted request and a verified draft see the numbers a decode saw. Tiles of
 * a chunk's tokens sharing each key read summed them in another order (with the fast-math
 * flags the compiler vectorizes each instance its own way): SmolLM2's greedy answers changed
 * under preemption and drafts, and small shapes differed at 1e-7. Attended one at a time, a
 * 512-token chunk's attention takes 1.2-1.6x the tiles' time, about 1 % of its prefill. */
static __attribute__((noinline)) void attend(
    const element *restrict query, float scale, int32_t begin, int32_t length,
    const int32_t *restrict table, const cached *restrict keys, const cached *restrict values,
    ptrdiff_t kv_heads, ptrdiff_t g0, ptrdiff_t g1, float *restrict q, float *restrict scores,
    element *restrict out) {
    const ptrdiff_t blocks = (length + BLOCK_SIZE - 1) / BLOCK_SIZE;
    /* The window's first block: the blocks before it are never read. Scores keep their
     * place in the row (position i at s[i]) so the arithmetic below is the same with and
     * without a window. */
    const ptrdiff_t j0 = begin / BLOCK_SIZE;
    const ptrdiff_t span = kv_heads * TILE; /* one block's tiles, every head */
    /* A head's scores row: its blocks, rounded up to whole cache lines, so each row starts
     * where its own length alone puts it (the scratch is line-aligned): the compiler's
     * vectorized softmax sums cannot split a row another way beside a longer request. */
    const ptrdiff_t stride = scores_stride(length);
    for (ptrdiff_t h = g0 * GROUP; h < g1 * GROUP; h++)
        for (int d = 0; d < HEAD_DIM; d++) q[h * HEAD_DIM + d] = load(query[h * HEAD_DIM + d]) * scale;
    /* Scores; the next block's key tiles (after the last, the first value tiles) are
     * fetched while this block's are summed. Positions past the length are summed too
     * (they are few) but never read after. */
    for (ptrdiff_t j = j0; j < blocks; j++) {
        const cached *next = j + 1 < blocks ? keys + (ptrdiff_t)table[j + 1] * span
                                             : values + (ptrdiff_t)table[j0] * span;
        for (ptrdiff_t g = g0; g < g1; g++) {
            prefetch_tile(next + g * TILE);
            const cached *restrict tile = keys + (ptrdiff_t)table[j] * span + g * TILE;
            vec block[SPLIT][GROUP][KEY_CHUNKS] = {0};
            for (int first = 0; first < HEAD_DIM; first += SPLIT)
                for (int part = 0; part < SPLIT; part++) {
                    const int d = first + part;
                    for (int c = 0; c < KEY_CHUNKS; c++) {
                        const vec k = load_cached_vec(tile + d * BLOCK_SIZE + c * LANES);
                        for (int h = 0; h < GROUP; h++)
                            block[part][h][c] += q[(g * GROUP + h) * HEAD_DIM + d] * k;
                    }
                }
            for (int h = 0; h < GROUP; h++)
                for (int c = 0; c < KEY_CHUNKS; c++) {
                    vec total = block[0][h][c];
                    for (int part = 1; part < SPLIT; part++) total += block[part][h][c];
                    memcpy(scores + (g * GROUP + h) * stride + j * BLOCK_SIZE + c * LANES, &total,
                           sizeof total);
                }
        }
    }
    for (ptrdiff_t h = g0 * GROUP; h < g1 * GROUP; h++) {
        float *restrict s = scores + h * stride;
        float top = s[begin];
        for (int32_t i = begin + 1; i < length; i++) top = s[i] > top ? s[i] : top;
        float sum = 0.0f;
        for (int32_t i = begin; i < length; i++) {
            const float e = exp_clamped(s[i] - top);
            s[i] = e;
            sum += e;
        }
        const float inverse = 1.0f / sum;
        for (int32_t i = begin; i < length; i++) s[i] *= inverse;
    }
    /* Outputs, OUTPUT_HEADS query heads at a time, so their sums stay in registers and each
     * value row is read once for them. The first pass fetches every head's value tiles of
     * the next block; later passes find them in cache. */
    for (ptrdiff_t g = g0; g < g1; g++) {
        for (int first = 0; first < GROUP; first += OUTPUT_HEADS) {
            const float *restrict p = scores + (g * GROUP + first) * stride;
            vec sum[OUTPUT_HEADS][VALUE_CHUNKS] = {0};
            for (ptrdiff_t j = j0; j < blocks; j++) {
                if (g == g0 && first == 0 && j + 1 < blocks)
                    for (ptrdiff_t u = g0; u < g1; u++)
                        prefetch_tile(values + (ptrdiff_t)table[j + 1] * span + u * TILE);
                const cached *restrict tile = values + (ptrdiff_t)table[j] * span + g * TILE;
                const ptrdiff_t left = length - j * BLOCK_SIZE;
                const int count = left < BLOCK_SIZE ? (int)left : BLOCK_SIZE;
                const int skip = j == j0 ? (int)(begin - j0 * BLOCK_SIZE) : 0;
                for (int i = skip; i < count; i++) {
                    const ptrdiff_t at = j * BLOCK_SIZE + i;
                    for (int c = 0; c < VALUE_CHUNKS; c++) {
                        const vec v = load_cached_vec(tile + i * HEAD_DIM + c * LANES);
                        for (int h = 0; h < OUTPUT_HEADS; h++) sum[h][c] += p[h * stride + at] * v;
                    }
                }
            }
            element *restrict to = out + (g * GROUP + first) * HEAD_DIM;
            for (int h = 0; h < OUTPUT_HEADS; h++)
                for (int c = 0; c < VALUE_CHUNKS; c++)
                    for (int l = 0; l < LANES; l++) to[h * HEAD_DIM + c * LANES + l] = store(sum[h][c][l]);
        }
    }
}

/* Attend `decodes` single-token queries over their histories in one layer's cache.
 *
 * query:        decode r's query heads at query + r * query_stride, [heads, HEAD_DIM]
 * keys, values: the layer's key and value tiles (see the top of this file)
 * tables:       decode r's block table at tables + r * table_stride (int32 block ids)
 * lengths:      positions decode r attends to (its history and itself), each >= 1
 * window:       each decode attends to its last `window` positions only; 0: all of them
 * out:          [decodes, kv_heads * GROUP, HEAD_DIM]
 *
 * Returns 0, or 1 if a thread could not allocate its scratch memory (out is then incomplete).
 */
int twostroke_paged_decode(const element *restrict query, ptrdiff_t query_stride,
                           const cached *restrict keys, const cached *restrict values,
                           const int32_t *restrict tables, ptrdiff_t table_stride,
                           const int32_t *restrict lengths, ptrdiff_t decodes,
                           ptrdiff_t kv_heads, float scale, ptrdiff_t window,
                           element *restrict out) {
    int32_t longest = 1;
    for (ptrdiff_t r = 0; r < decodes; r++) longest = lengths[r] > longest ? lengths[r] : longest;
    /* Fewer decodes than threads: each decode's heads are split among them instead. */
    const ptrdiff_t parts = decodes < omp_get_max_threads() ? kv_heads : 1;
    int failed = 0;
#pragma omp parallel
    {
        float *scratch = scratch_for(kv_heads, longest);
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (ptrdiff_t item = 0; item < decodes * parts; item++) {
            if (scratch == NULL) continue;
            const ptrdiff_t r = item / parts, part = item % parts;
            attend(query + r * query_stride, scale, window_start(lengths[r], window), lengths[r],
                   tables + r * table_stride, keys, values, kv_heads, part * kv_heads / parts,
                   (part + 1) * kv_heads / parts, scratch, scratch + queries_size(kv_heads),
                   out + r * kv_heads * GROUP * HEAD_DIM);
        }
        free(scratch);
    }
    return failed;
}

/* Attend `chunks` runs of consecutive query tokens (prefill chunks, and decodes as chunks
 * of one) over their histories in one layer's cache: chunk c's tokens are at positions
 * starts[c] .. starts[c] + counts[c] - 1, each attending to every position up to its own,
 * its own keys and values already written.
 *
 * query:        the query heads of the chunks' tokens, token i of chunk c at
 *               query + (offsets[c] + i) * query_stride, [heads, HEAD_DIM]
 * keys, values: the layer's key and value tiles (see the top of this file)
 * tables:       chunk c's block table at tables + c * table_stride (int32 block ids)
 * starts, counts, offsets: int32 [chunks] each; counts >= 1
 * window:       each token attends to its last `window` positions only; 0: all of them
 * out:          token i of chunk c's output at out + (offsets[c] + i) * out_stride,
 *               [kv_heads * GROUP, HEAD_DIM]
 *
 * Work is split over tokens, each attended by attend() as a decode is. Returns 0, or 1 if
 * memory for the work list or a thread's scratch could not be allocated (out is then
 * incomplete).
 */
int twostroke_paged_prefill(const element *restrict query, ptrdiff_t query_stride,
                            const cached *restrict keys, const cached *restrict values,
                            const int32_t *restrict tables, ptrdiff_t table_stride,
                            const int32_t *restrict starts, const int32_t *restrict counts,
                            const int32_t *restrict offsets, ptrdiff_t chunks, ptrdiff_t kv_heads,
                            float scale, ptrdiff_t window, element *restrict out,
                            ptrdiff_t out_stride) {
    ptrdiff_t tokens = 0;
    int32_t longest = 1;
    for (ptrdiff_t c = 0; c < chunks; c++) {
        tokens += counts[c];
        const int32_t end = starts[c] + counts[c];
        longest = end > longest ? end : longest;
    }
    /* Each token's chunk and place in it. */
    int32_t *work = malloc(sizeof(int32_t) * (size_t)(2 * tokens + 1));
    if (work == NULL) return 1;
    ptrdiff_t at = 0;
    for (ptrdiff_t c = 0; c < chunks; c++)
        for (int32_t i = 0; i < counts[c]; i++, at++) {
            work[2 * at] = (int32_t)c;
            work[2 * at + 1] = i;
        }
    int failed = 0;
#pragma omp parallel
    {
        float *scratch = scratch_for(kv_heads, longest);
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        /* Later tokens attend to more positions: handed out longest first would balance
         * better, but in order the threads read neighbouring tokens' blocks together. */
#pragma omp for schedule(dynamic, 4)
        for (ptrdiff_t item = 0; item < tokens; item++) {
            if (scratch == NULL) continue;
            const ptrdiff_t c = work[2 * item];
            const int32_t i = work[2 * item + 1];
            const ptrdiff_t row = offsets[c] + i;
            const int32_t length = starts[c] + i + 1;
            attend(query + row * query_stride, scale, window_start(length, window), length,
                   tables + c * table_stride, keys, values, kv_heads, 0, kv_heads, scratch,
                   scratch + queries_size(kv_heads), out + row * out_stride);
        }
        free(scratch);
    }
    free(work);
    return failed;
}
