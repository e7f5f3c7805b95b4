/* Row copies of deltastream's C extensions (tracking and publishing native.c): prefetching
 * a row a few rows before it is copied or read (the rows are cache misses in tables far
 * larger than the cache), and one row's copy at the usual widths. */
#ifndef DELTASTREAM_NATIVE_ROWS_H
#define DELTASTREAM_NATIVE_ROWS_H

#include <stdint.h>
#include <string.h>

#if defined(__GNUC__)
#define PREFETCH(p) __builtin_prefetch((const void *)(p), 0, 3)
#define PREFETCH_W(p) __builtin_prefetch((const void *)(p), 1, 3)
#else
#define PREFETCH(p) ((void)0)
#define PREFETCH_W(p) ((void)0)
#endif

#define AHEAD 16 /* rows between a row's prefetch and its copy */

/* One row: the usual widths (32 or 64 f32 / 16-bit values, ...) with a constant size, which
 * the compiler inlines as a few vector moves instead of a call to memcpy. */
static inline void copy_row(uint8_t *dst, const uint8_t *src, Py_ssize_t rb) {
    switch (rb) {
    case 64:
        memcpy(dst, src, 64);
        return;
    case 128:
        memcpy(dst, src, 128);
        return;
    case 256:
        memcpy(dst, src, 256);
        return;
    default:
        memcpy(dst, src, (size_t)rb);
    }
}

#endif
