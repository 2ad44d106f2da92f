/* A 64-bit finaliser (MurmurHash3's fmix64 constants): spreads a block hash over a
 * table's slots.  No Python API; included by the compactor's and the recorder's C. */
#ifndef COALESCE_CMIX_H
#define COALESCE_CMIX_H

#include <stdint.h>

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

#endif
