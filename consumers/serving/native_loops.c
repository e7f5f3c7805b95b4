/* consumers.serving.native: the loops (probe, gather, the writer's find and insert).
 * The layout, protocol and Python API are described in native.c. */
#include "native_loops.h"

/* ---------------------------------------------------------------- f16 -> f32 */

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, f;
    if (exp == 0) {
        if (mant == 0) {
            f = sign;
        } else {  /* subnormal: normalize */
            exp = 113;
            while (!(mant & 0x400u)) {
                mant <<= 1;
                exp--;
            }
            f = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        f = sign | 0x7f800000u | (mant << 13);  /* inf, nan (payload kept) */
    } else {
        f = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float r;
    memcpy(&r, &f, sizeof r);
    return r;
}

static void f16_row_portable(float *dst, const uint16_t *src, Py_ssize_t dim) {
    for (Py_ssize_t j = 0; j < dim; j++)
        dst[j] = half_to_float(src[j]);
}

#ifdef HAVE_X86
__attribute__((target("avx,f16c")))
static void f16_row_f16c(float *dst, const uint16_t *src, Py_ssize_t dim) {
    Py_ssize_t j = 0;
    for (; j + 8 <= dim; j += 8)
        _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + j))));
    for (; j < dim; j++)
        dst[j] = half_to_float(src[j]);
}
#endif

typedef void (*f16_row_fn)(float *, const uint16_t *, Py_ssize_t);
static f16_row_fn f16_row = f16_row_portable;

/* ---------------------------------------------------------------- the loops */

/* Home buckets are prefetched PROBE_AHEAD keys before they are probed: prefetch_start
 * before the loop over keys [0, n), prefetch_ahead(..., i) as key i is probed. */
static inline void prefetch_start(const Index *ix, const int64_t *keys, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n && i < PROBE_AHEAD; i++)
        PREFETCH(ix->b + 2 * home_of(keys[i], ix->shift));
}

static inline void prefetch_ahead(const Index *ix, const int64_t *keys, Py_ssize_t n,
                                  Py_ssize_t i) {
    if (i + PROBE_AHEAD < n)
        PREFETCH(ix->b + 2 * home_of(keys[i + PROBE_AHEAD], ix->shift));
}

/* Prefetch the cache lines of bytes [p, p + n) (at most ROW_PREFETCH_MAX of them). */
static inline void prefetch_lines(const char *p, Py_ssize_t n, int write) {
    const char *end = p + (n < ROW_PREFETCH_MAX ? n : ROW_PREFETCH_MAX);
    for (p = (const char *)((uintptr_t)p & ~(uintptr_t)63); p < end; p += 64) {
        if (write)
            PREFETCH_W(p);
        else
            PREFETCH(p);
    }
}

static inline void prefetch_row(const Rows *r, int32_t slot) {
    prefetch_lines(r->base + (Py_ssize_t)slot * r->row_bytes, r->row_bytes, 0);
}

/* Rows of n keys into out [n, dim]; returns 1 when some slot lay outside the rows.
 * Requests below BULK_MIN ids. A chunk at a time: probe its ids (home buckets prefetched
 * PROBE_AHEAD ids ahead), then copy its rows (each prefetched ROW_AHEAD rows ahead).
 * Measured against one fused loop (probe id i, prefetch its row, copy row i - lag): as
 * fast or a little faster, for 256 ids and in bulk. */
static int gather_chunks(const Index *ix, int col, const Rows *r, const int64_t *keys,
                         Py_ssize_t n, float *out) {
    int32_t slots[CHUNK];
    int bad = 0;
    for (Py_ssize_t c = 0; c < n; c += CHUNK) {
        Py_ssize_t m = n - c < CHUNK ? n - c : CHUNK;
        const int64_t *k = keys + c;
        prefetch_start(ix, k, m);
        for (Py_ssize_t i = 0; i < m; i++) {
            prefetch_ahead(ix, k, m, i);
            int32_t s = probe(ix, col, k[i]);
            if (s >= r->nrows) {  /* only a racing writer or corrupt memory */
                bad = 1;
                s = 0;
            }
            slots[i] = s;
        }
        for (Py_ssize_t i = 0; i < m && i < ROW_AHEAD; i++)
            if (slots[i] > 0)
                prefetch_row(r, slots[i]);
        for (Py_ssize_t i = 0; i < m; i++) {
            if (i + ROW_AHEAD < m && slots[i + ROW_AHEAD] > 0)
                prefetch_row(r, slots[i + ROW_AHEAD]);
            int32_t s = slots[i];
            const char *src = r->base + (Py_ssize_t)s * r->row_bytes;
            float *dst = out + (c + i) * r->dim;
            if (s <= 0)  /* absent: zeros (slot 0 is the zero row: no need to read it) */
                memset(dst, 0, (size_t)r->dim * sizeof(float));
            else if (r->half)
                f16_row(dst, (const uint16_t *)src, r->dim);
            else
                memcpy(dst, src, (size_t)r->row_bytes);
        }
    }
    return bad;
}

void ds_slots_of(const Index *ix, int col, const int64_t *keys, Py_ssize_t n,
                 int32_t *out) {
    prefetch_start(ix, keys, n);
    for (Py_ssize_t i = 0; i < n; i++) {
        prefetch_ahead(ix, keys, n, i);
        out[i] = probe(ix, col, keys[i]);
    }
}

/* Bucket of key live in copy col, or -1 (same walk as probe()). */
static inline int64_t probe_pos(const Index *ix, int col, int64_t key, int32_t *slot) {
    uint64_t p = home_of(key, ix->shift);
    for (uint64_t k = 0; k <= ix->mask; k++) {
        const int64_t *bk = ix->b + 2 * p;
        int32_t v = ((const int32_t *)bk)[2 + col];
        if (v == 0)
            break;
        if (v > 0 && bk[0] == key) {
            *slot = v;
            return (int64_t)p;
        }
        p = (p + 1) & ix->mask;
    }
    *slot = 0;
    return -1;
}

void ds_find_all(const Index *ix, int col, const int64_t *keys, Py_ssize_t n,
                 int64_t *pos, int32_t *slot) {
    prefetch_start(ix, keys, n);
    for (Py_ssize_t i = 0; i < n; i++) {
        prefetch_ahead(ix, keys, n, i);
        pos[i] = probe_pos(ix, col, keys[i], slot + i);
    }
}

/* Insert keys (unique, absent from copy col) with slots: each takes the first bucket of
 * its walk that is free, i.e. <= 0 in copy col (c: col, or 0 for both copies) and in copy
 * other when other >= 0. The key is stored before the value: a bucket becomes live only
 * with its value. Returns the buckets newly used, or -1 - i when key i found no free
 * bucket (keys before i stay inserted: the caller undoes the copy it was building). */
Py_ssize_t ds_insert_all(int64_t *b, uint64_t mask, int shift, const int64_t *keys,
                         const int32_t *slots, Py_ssize_t n, int col, int other,
                         int64_t *pos) {
    int c = col < 0 ? 0 : col;
    Py_ssize_t used = 0;
    for (Py_ssize_t i = 0; i < n && i < PROBE_AHEAD; i++)
        PREFETCH_W(b + 2 * home_of(keys[i], shift));
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PROBE_AHEAD < n)
            PREFETCH_W(b + 2 * home_of(keys[i + PROBE_AHEAD], shift));
        uint64_t p = home_of(keys[i], shift);
        uint64_t k = 0;
        for (; k <= mask; k++) {
            int32_t *v = (int32_t *)(b + 2 * p) + 2;
            if (v[c] <= 0 && (other < 0 || v[other] <= 0))
                break;
            p = (p + 1) & mask;
        }
        if (k > mask)
            return -1 - i;
        int64_t *bk = b + 2 * p;
        int32_t *v = (int32_t *)bk + 2;
        used += v[c] == 0;
        bk[0] = keys[i];
        if (col < 0) {
            v[0] = slots[i];
            v[1] = slots[i];
        } else {
            v[col] = slots[i];
        }
        pos[i] = (int64_t)p;
    }
    return used;
}

/* ---------------------------------------------------------------- bulk requests
 *
 * Where a table lives in 4 KiB pages (shared memory here: no huge pages for shmem), a
 * random row costs a page walk as well as a cache miss, and prefetching overlaps only as
 * many walks as the core has walkers. A bulk request therefore copies its rows in address
 * order: its ids are probed in request order (as above), their (slot, position) pairs
 * counting-sorted into 2^GROUP_BITS groups of slots (each group a slice of the rows whose
 * pages the TLB holds), and each row copied to its place in out, prefetched ahead together
 * with that place (out is written at random). Measured at 4M rows x 64 f32, 1M ids: 1.5x
 * the throughput of the request-order path on a shared table, the same on a private one
 * (huge pages). Sorting by home bucket before probing was tried too: no faster. */

typedef struct {
    int32_t slot;
    uint32_t pos;
} Fetch;

static void *scratch(size_t bytes) {
#ifdef HAVE_MMAN
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, bytes, MADV_HUGEPAGE);  /* scattered writes into n/1024 streams: few pages */
#endif
    return p;
#else
    return malloc(bytes);
#endif
}

static void unscratch(void *p, size_t bytes) {
#ifdef HAVE_MMAN
    munmap(p, bytes);
#else
    (void)bytes;
    free(p);
#endif
}

/* gather() for a bulk request; -1 when out of memory (nothing written). */
static int gather_sorted(const Index *ix, int col, const Rows *r, const int64_t *keys,
                         Py_ssize_t n, float *out) {
    size_t bytes = (size_t)n * sizeof(Fetch);
    Fetch *probed = scratch(bytes);
    if (probed == NULL)
        return -1;
    Fetch *f = scratch(bytes);
    if (f == NULL) {
        unscratch(probed, bytes);
        return -1;
    }
    int64_t max_slot = 0;
    int bad = 0;
    prefetch_start(ix, keys, n);
    for (Py_ssize_t i = 0; i < n; i++) {
        prefetch_ahead(ix, keys, n, i);
        int32_t s = probe(ix, col, keys[i]);
        if (s >= r->nrows) {  /* only a racing writer or corrupt memory */
            bad = 1;
            s = 0;
        }
        probed[i].slot = s;
        probed[i].pos = (uint32_t)i;
        if (s > max_slot)
            max_slot = s;
    }
    int sshift = 0;
    while ((max_slot >> sshift) >= (1 << GROUP_BITS))
        sshift++;
    size_t start[(1 << GROUP_BITS) + 1];
    memset(start, 0, sizeof start);
    for (Py_ssize_t i = 0; i < n; i++)
        start[(probed[i].slot >> sshift) + 1]++;
    for (int g = 1; g <= (1 << GROUP_BITS); g++)
        start[g] += start[g - 1];
    for (Py_ssize_t i = 0; i < n; i++)
        f[start[probed[i].slot >> sshift]++] = probed[i];
    unscratch(probed, bytes);
    for (Py_ssize_t k = 0; k < n && k < ROW_AHEAD; k++)
        if (f[k].slot > 0)
            prefetch_row(r, f[k].slot);
    for (Py_ssize_t k = 0; k < n; k++) {
        if (k + ROW_AHEAD < n) {  /* the row, and the place in out (random writes) */
            const Fetch *a = f + k + ROW_AHEAD;
            if (a->slot > 0)
                prefetch_row(r, a->slot);
            prefetch_lines((const char *)(out + (Py_ssize_t)a->pos * r->dim),
                           r->dim * (Py_ssize_t)sizeof(float), 1);
        }
        int32_t s = f[k].slot;
        const char *src = r->base + (Py_ssize_t)s * r->row_bytes;
        float *dst = out + (Py_ssize_t)f[k].pos * r->dim;
        if (s <= 0)
            memset(dst, 0, (size_t)r->dim * sizeof(float));
        else if (r->half)
            f16_row(dst, (const uint16_t *)src, r->dim);
        else
            memcpy(dst, src, (size_t)r->row_bytes);
    }
    unscratch(f, bytes);
    return bad;
}

/* Rows of n keys into out [n, dim]; returns 1 when some slot lay outside the rows. */
int ds_gather(const Index *ix, int col, const Rows *r, const int64_t *keys,
              Py_ssize_t n, float *out) {
    if (n >= BULK_MIN && (uint64_t)n <= UINT32_MAX) {
        int bad = gather_sorted(ix, col, r, keys, n, out);
        if (bad >= 0)
            return bad;
    }  /* else, or out of memory for the scratch arrays: the chunked path */
    return gather_chunks(ix, col, r, keys, n, out);
}

const char *ds_f16_init(void) {
#ifdef HAVE_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c")) {
        f16_row = f16_row_f16c;
        return "f16c";
    }
#endif
    return "portable";
}
