/* The loops of consumers.serving.native (native_loops.c), and what they share with the
 * argument handling in native.c: the index layout, its hash and probe, the row layout.
 * See native.c for the layout and protocol.
 */
#ifndef DELTASTREAM_NATIVE_LOOPS_H
#define DELTASTREAM_NATIVE_LOOPS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#define HAVE_MMAN 1
#else
#include <stdlib.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_X86 1
#endif

#if defined(__GNUC__)
#define PREFETCH(p) __builtin_prefetch((const void *)(p), 0, 3)
#define LOAD(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define PREFETCH_W(p) __builtin_prefetch((const void *)(p), 1, 3)
#define ACQUIRE_FENCE() __atomic_thread_fence(__ATOMIC_ACQUIRE)
#else
#define PREFETCH(p) ((void)0)
#define PREFETCH_W(p) ((void)0)
#define LOAD(p) (*(p))
#define ACQUIRE_FENCE() ((void)0)
#endif

#define H_PREP 17          /* consumers/serving/memory.py (a test compares) */
#define MULT 0x9E3779B97F4A7C15ULL
#define PROBE_AHEAD 32     /* ids between the prefetch of a home bucket and its probe */
#define ROW_AHEAD 16       /* rows between the prefetch of a row and its copy */
#define CHUNK 1024         /* ids probed before their rows are copied (a stack array) */
#define ROW_PREFETCH_MAX 1024  /* bytes of a row prefetched at most (the rest streams) */
#define BULK_MIN 65536     /* requests of this many ids take the sorted path */
#define GROUP_BITS 10      /* ... sorted into 2^GROUP_BITS groups of row slots */

typedef struct {
    const int64_t *b;   /* buckets: 2 words each */
    uint64_t mask;
    int shift;          /* 64 - log2(B) */
} Index;

static inline uint64_t home_of(int64_t key, int shift) {
    uint64_t x = (uint64_t)key;
    x ^= x >> 32;
    x *= MULT;
    return x >> shift;
}

/* Slot of key in value copy col, 0 when absent. Bounded by B buckets: a racing writer can
 * leave no EMPTY bucket in the way for a reader that is about to be told to retry. */
static inline int32_t probe(const Index *ix, int col, int64_t key) {
    uint64_t p = home_of(key, ix->shift);
    for (uint64_t k = 0; k <= ix->mask; k++) {
        const int64_t *bk = ix->b + 2 * p;
        int32_t v = LOAD((const int32_t *)bk + 2 + col);
        if (v == 0)
            return 0;  /* EMPTY: the key is not past this bucket */
        if (v > 0 && LOAD(bk) == key)
            return v;
        p = (p + 1) & ix->mask;  /* another key, or DELETED: go on */
    }
    return 0;
}


typedef struct {
    const char *base;    /* rows */
    Py_ssize_t nrows;
    Py_ssize_t dim;
    Py_ssize_t row_bytes;
    int half;            /* f16 storage */
} Rows;

/* Rows of n keys (copy col) into out [n, dim]; returns 1 when some slot lay outside the
 * rows. Requests of BULK_MIN+ ids are copied in row order (see native_loops.c). */
int ds_gather(const Index *ix, int col, const Rows *r, const int64_t *keys, Py_ssize_t n,
              float *out);
/* Slot of each key in copy col, 0 when absent. */
void ds_slots_of(const Index *ix, int col, const int64_t *keys, Py_ssize_t n, int32_t *out);
/* Bucket of each key live in copy col or -1, and its slot or 0. */
void ds_find_all(const Index *ix, int col, const int64_t *keys, Py_ssize_t n, int64_t *pos,
                 int32_t *slot);
/* Insert keys with slots (see native_loops.c); buckets newly used, or -1 - i when key i
 * found no free bucket. */
Py_ssize_t ds_insert_all(int64_t *b, uint64_t mask, int shift, const int64_t *keys,
                         const int32_t *slots, Py_ssize_t n, int col, int other,
                         int64_t *pos);
/* Pick the f16 -> f32 row conversion this CPU supports; returns its name. */
const char *ds_f16_init(void);

#ifdef HAVE_MMAN
/* What ds_warm_follow (native_warm.c) follows: a mapping of a file that grows. */
typedef struct {
    const uint8_t *buf;      /* the mapping */
    int64_t len;             /* its bytes */
    const char *path;        /* the file mapped (its allocated bytes are warmed) */
    const char *next;        /* a file whose completion ends the loop, or NULL */
    const int64_t *gen_word; /* a header word ... */
    int64_t gen;             /* ... whose change from this value ends the loop */
    int64_t page;            /* bytes between two reads */
    int64_t align;           /* only whole blocks of this many bytes are read */
    int64_t step;            /* bytes read between two looks at gen_word */
    int64_t timeout_ns;
    int64_t busy_ns;         /* pause once caught up with a file that just grew */
    int64_t idle_ns;         /* pause while it does not grow */
} WarmArgs;

enum { WARM_TIMEOUT, WARM_GEN, WARM_NEXT, WARM_GONE, WARM_ERROR };

/* Read one byte per page of the allocated part of a->path's mapping past *done (updated
 * as it goes) until a->gen_word changes, a->next is complete, the file is gone or cannot
 * be stat'ed (*err = errno), or the timeout passes; returns which (WARM_*). Call without
 * the GIL. */
int ds_warm_follow(const WarmArgs *a, int64_t *done, int *err);
#endif

#endif
