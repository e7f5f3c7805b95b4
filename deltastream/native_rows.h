/* Row copies of deltastream's C extensions (tracking and publishing native.c): prefetching
 * a row a few rows before it is copied or read (the rows are cache misses in tables far
 * larger than the cache), one row's copy at the usual widths (or streamed, for a
 * destination not read again soon), and n rows copied between places named by index
 * arrays. */
#ifndef DELTASTREAM_NATIVE_ROWS_H
#define DELTASTREAM_NATIVE_ROWS_H

#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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

/* One row to a destination that is not read again soon: with full 16-byte pieces at 16-byte
 * aligned addresses, streaming stores (no read of the destination's lines first; the
 * caller fences with _mm_sfence before another thread may read them). */
static inline void put_row(uint8_t *dst, const uint8_t *src, Py_ssize_t rb) {
#if defined(__SSE2__)
    if (!(rb & 15) && !((uintptr_t)dst & 15)) {
        for (Py_ssize_t b = 0; b < rb; b += 16)
            _mm_stream_si128((__m128i *)(dst + b), _mm_loadu_si128((const __m128i *)(src + b)));
        return;
    }
#endif
    copy_row(dst, src, rb);
}

/* dst row dst_at[i] = src row src_at[i] for i < n, rows of rb bytes (an index NULL: row i);
 * the source row (both its ends) and the destination row i + AHEAD are prefetched before
 * row i is copied; with streamed, the rows are written by put_row. The indices are the
 * caller's to check. */
static inline void move_rows_at(uint8_t *dst, const int64_t *dst_at, const uint8_t *src,
                                const int64_t *src_at, Py_ssize_t n, Py_ssize_t rb,
                                int streamed) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            const uint8_t *r = src + (uint64_t)(src_at ? src_at[i + AHEAD] : i + AHEAD) * rb;
            PREFETCH(r);
            PREFETCH(r + rb - 1);
            if (dst_at)
                PREFETCH_W(dst + (uint64_t)dst_at[i + AHEAD] * rb);
        }
        uint8_t *to = dst + (uint64_t)(dst_at ? dst_at[i] : i) * rb;
        const uint8_t *from = src + (uint64_t)(src_at ? src_at[i] : i) * rb;
        if (streamed)
            put_row(to, from, rb);
        else
            copy_row(to, from, rb);
    }
}

/* move_rows_at with ordinary stores. */
static inline void copy_rows_at(uint8_t *dst, const int64_t *dst_at, const uint8_t *src,
                                const int64_t *src_at, Py_ssize_t n, Py_ssize_t rb) {
    move_rows_at(dst, dst_at, src, src_at, n, rb, 0);
}

#endif
