/* Row copies of deltastream's C extensions (tracking and publishing native.c): prefetching
 * a row a few rows before it is copied or read (the rows are cache misses in tables far
 * larger than the cache), one row's copy at the usual widths, and n rows copied between
 * places named by index arrays. */
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

/* dst row dst_at[i] = src row src_at[i] for i < n, rows of rb bytes (an index NULL: row i);
 * the source row (both its ends) and the destination row i + AHEAD are prefetched before
 * row i is copied. The indices are the caller's to check. */
static inline void copy_rows_at(uint8_t *dst, const int64_t *dst_at, const uint8_t *src,
                                const int64_t *src_at, Py_ssize_t n, Py_ssize_t rb) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            const uint8_t *r = src + (uint64_t)(src_at ? src_at[i + AHEAD] : i + AHEAD) * rb;
            PREFETCH(r);
            PREFETCH(r + rb - 1);
            if (dst_at)
                PREFETCH_W(dst + (uint64_t)dst_at[i + AHEAD] * rb);
        }
        copy_row(dst + (uint64_t)(dst_at ? dst_at[i] : i) * rb,
                 src + (uint64_t)(src_at ? src_at[i] : i) * rb, rb);
    }
}

#endif
