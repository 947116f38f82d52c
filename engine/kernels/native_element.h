/* What twostroke's compiled CPU kernels share: the element type, its conversions to and from
 * float (where all their arithmetic happens), a vectorizable exp, and the instruction set the
 * library was compiled for.
 *
 *   -DELEMENT_BF16   bfloat16 tensors (rounded to nearest, ties to even, as torch does);
 *                    else float32.
 *   -DCACHE_F32, -DCACHE_F16, -DCACHE_BF16
 *                    the KV cache's element type (`cached`), where it differs from the
 *                    activations' (the engine's kv_cache_dtype); else `element`.
 */
#ifndef TWOSTROKE_NATIVE_ELEMENT_H
#define TWOSTROKE_NATIVE_ELEMENT_H

#include <stdint.h>
#include <string.h>

static inline float bf16_load(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
static inline uint16_t bf16_store(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16; /* to nearest even */
    const uint32_t quiet = (bits >> 16) | 0x40u;                             /* NaN stays NaN */
    /* A select, not a branch, so that loops over elements vectorize. */
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

#ifdef ELEMENT_BF16
typedef uint16_t element;
static inline float load(element x) { return bf16_load(x); }
static inline element store(float f) { return bf16_store(f); }
#else
typedef float element;
static inline float load(element x) { return x; }
static inline element store(float f) { return f; }
#endif

/* The KV cache's elements. IEEE half precision through the compiler's _Float16 (one
 * instruction each way where the instruction set has F16C, as x86-64-v3 does; libgcc's
 * conversions otherwise), rounded to nearest, ties to even, as torch's .to(float16). */
#if defined(CACHE_F16)
#define CACHE_DIFFERS 1
typedef uint16_t cached;
static inline float load_cached(cached x) {
    _Float16 h;
    memcpy(&h, &x, sizeof h);
    return (float)h;
}
static inline cached store_cached(float f) {
    const _Float16 h = (_Float16)f;
    cached x;
    memcpy(&x, &h, sizeof x);
    return x;
}
#elif defined(CACHE_BF16) && !defined(ELEMENT_BF16)
#define CACHE_DIFFERS 1
typedef uint16_t cached;
static inline float load_cached(cached x) { return bf16_load(x); }
static inline cached store_cached(float f) { return bf16_store(f); }
#elif defined(CACHE_F32) && defined(ELEMENT_BF16)
#define CACHE_DIFFERS 1
typedef float cached;
static inline float load_cached(cached x) { return x; }
static inline cached store_cached(float f) { return f; }
#else
#define CACHE_DIFFERS 0
typedef element cached;
static inline float load_cached(cached x) { return load(x); }
static inline cached store_cached(float f) { return store(f); }
#endif

/* The widest vector registers this library's code may use: 512 (AVX-512), 256 (AVX), or 128
 * (SSE, the x86-64 baseline, and any other machine). The compile flags decide it
 * (twostroke.gpu.isa's personality caps them), so a library says which of its paths it runs. */
int twostroke_vector_bits(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX__)
    return 256;
#else
    return 128;
#endif
}

/* exp(x), x clamped to [-87, 88]: 2^n * p(r) with x = n ln 2 + r, |r| <= ln 2 / 2 (Cephes'
 * expf; relative error about 2e-7). A polynomial the compiler vectorizes, where a call to
 * the C library's expf would keep the loop scalar. */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

#endif
