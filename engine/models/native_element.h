/* The element type of twostroke's compiled CPU kernels, and its conversions to and from
 * float, where all their arithmetic happens.
 *
 *   -DELEMENT_BF16   bfloat16 tensors (rounded to nearest, ties to even, as torch does);
 *                    else float32.
 */
#ifndef TWOSTROKE_NATIVE_ELEMENT_H
#define TWOSTROKE_NATIVE_ELEMENT_H

#include <stdint.h>
#include <string.h>

#ifdef ELEMENT_BF16
typedef uint16_t element;
static inline float load(element x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
static inline element store(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (element)((bits >> 16) | 0x40u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest, ties to even */
    return (element)(bits >> 16);
}
#else
typedef float element;
static inline float load(element x) { return x; }
static inline element store(float f) { return f; }
#endif

#endif
