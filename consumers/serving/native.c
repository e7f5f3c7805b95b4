/* consumers.serving.native: the lookup path of a serving table in C.
 *
 * One call probes the id index for every id and gathers the rows of the slots found into a
 * float32 output (f32 or f16 storage), with software prefetching: the home bucket of an id
 * is prefetched PROBE_AHEAD ids before it is probed, a row ROW_AHEAD rows before it is
 * copied. A lookup of random ids is a chain of cache and TLB misses; numpy takes them one
 * after another, prefetching overlaps them (distances tuned on a 2-core AMD EPYC VM; the
 * results were flat within noise around these values).
 *
 * Same layout and protocol as consumers/id_index.py and consumers/serving/core.py (read
 * those first): buckets are int64 [B, 2] (B a power of 2): the key, then two int32 value
 * copies (a row slot >= 1, 0 EMPTY, -1 DELETED). Home bucket: the top log2(B) bits of
 * (key ^ key >> 32) * 0x9E3779B97F4A7C15; linear probing; the first bucket holding the key
 * live in the copy read, or EMPTY, decides. Readers never lock: the caller read state s
 * from hdr[H_SEQ] before choosing the index and rows; the read is valid iff
 * hdr[H_PREP] <= s + 1 after every row was copied (else the writer began to rebuild copy
 * s & 1 or to reuse a slot of state s: retry). Whatever a racing writer leaves in memory,
 * a probe stops after B buckets and a slot outside the rows is never dereferenced.
 *
 * Python API (buffers: anything exporting a C-contiguous buffer, e.g. numpy arrays):
 *   read_rows(hdr, tab, rows, s, keys, out, nogil) -> 1 valid, 0 overtaken (retry),
 *       2 valid but the index named a slot outside rows (a corrupt table)
 *   lookup_slots(tab, keys, col, out, nogil) -> None (out: int32 [n], slot or 0)
 * The writer's side (the caller holds the table's write lock; consumers/id_index.py):
 *   index_find(tab, keys, col, pos, slot, nogil) -> None (pos: int64 [n], the bucket holding
 *       the key live in copy col or -1; slot: int32 [n], its slot or 0)
 *   index_insert(tab, keys, slots, col, other, pos, nogil) -> buckets newly used (they were
 *       EMPTY); col -1: both copies; other -1: none. ValueError when no bucket is free.
 * nogil: release the GIL around the loop (worth it for big requests only: taking the GIL
 * back can wait for another thread's switch interval).
 */
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

typedef struct {
    const char *base;    /* rows */
    Py_ssize_t nrows;
    Py_ssize_t dim;
    Py_ssize_t row_bytes;
    int half;            /* f16 storage */
} Rows;

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
        for (Py_ssize_t i = 0; i < m && i < PROBE_AHEAD; i++)
            PREFETCH(ix->b + 2 * home_of(k[i], ix->shift));
        for (Py_ssize_t i = 0; i < m; i++) {
            if (i + PROBE_AHEAD < m)
                PREFETCH(ix->b + 2 * home_of(k[i + PROBE_AHEAD], ix->shift));
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

static void slots_of(const Index *ix, int col, const int64_t *keys, Py_ssize_t n,
                     int32_t *out) {
    for (Py_ssize_t i = 0; i < n && i < PROBE_AHEAD; i++)
        PREFETCH(ix->b + 2 * home_of(keys[i], ix->shift));
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PROBE_AHEAD < n)
            PREFETCH(ix->b + 2 * home_of(keys[i + PROBE_AHEAD], ix->shift));
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

static void find_all(const Index *ix, int col, const int64_t *keys, Py_ssize_t n,
                     int64_t *pos, int32_t *slot) {
    for (Py_ssize_t i = 0; i < n && i < PROBE_AHEAD; i++)
        PREFETCH(ix->b + 2 * home_of(keys[i], ix->shift));
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PROBE_AHEAD < n)
            PREFETCH(ix->b + 2 * home_of(keys[i + PROBE_AHEAD], ix->shift));
        pos[i] = probe_pos(ix, col, keys[i], slot + i);
    }
}

/* Insert keys (unique, absent from copy col) with slots: each takes the first bucket of
 * its walk that is free, i.e. <= 0 in copy col (c: col, or 0 for both copies) and in copy
 * other when other >= 0. The key is stored before the value: a bucket becomes live only
 * with its value. Returns the buckets newly used, or -1 - i when key i found no free
 * bucket (keys before i stay inserted: the caller undoes the copy it was building). */
static Py_ssize_t insert_all(int64_t *b, uint64_t mask, int shift, const int64_t *keys,
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
    for (Py_ssize_t i = 0; i < n && i < PROBE_AHEAD; i++)
        PREFETCH(ix->b + 2 * home_of(keys[i], ix->shift));
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PROBE_AHEAD < n)
            PREFETCH(ix->b + 2 * home_of(keys[i + PROBE_AHEAD], ix->shift));
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
static int gather(const Index *ix, int col, const Rows *r, const int64_t *keys,
                  Py_ssize_t n, float *out) {
    if (n >= BULK_MIN && (uint64_t)n <= UINT32_MAX) {
        int bad = gather_sorted(ix, col, r, keys, n, out);
        if (bad >= 0)
            return bad;
    }  /* else, or out of memory for the scratch arrays: the chunked path */
    return gather_chunks(ix, col, r, keys, n, out);
}

/* ---------------------------------------------------------------- arguments */

/* The type code of a buffer format ("<f", "=e", "l" -> 'f', 'e', 'l'). */
static char code_of(const Py_buffer *v) {
    const char *f = v->format ? v->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    return f[0] && !f[1] ? f[0] : '?';
}

static int is_int64(const Py_buffer *v) {
    char c = code_of(v);
    return v->itemsize == 8 && (c == 'q' || c == 'l');
}

static int get_buf(PyObject *obj, Py_buffer *v, int writable, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, v, flags) < 0) {
        PyErr_Format(PyExc_ValueError, "%s: expected a C-contiguous%s array", what,
                     writable ? " writable" : "");
        return -1;
    }
    return 0;
}

static int index_of(const Py_buffer *tab, Index *ix) {
    Py_ssize_t words = tab->len / 8;
    uint64_t b = (uint64_t)(words / 2);
    if (!is_int64(tab) || tab->len % 16 || b < 16 || (b & (b - 1))) {
        PyErr_Format(PyExc_ValueError, "tab: expected int64 [B, 2] with B a power of 2 >= 16, "
                     "got %zd bytes of format %s", tab->len, tab->format ? tab->format : "B");
        return -1;
    }
    int log2b = 0;
    while (((uint64_t)1 << log2b) < b)
        log2b++;
    ix->b = (const int64_t *)tab->buf;
    ix->mask = b - 1;
    ix->shift = 64 - log2b;
    return 0;
}

static int keys_of(const Py_buffer *keys) {
    if (!is_int64(keys) || keys->ndim != 1) {
        PyErr_Format(PyExc_ValueError, "keys: expected a 1-D int64 array, got format %s "
                     "with %d dimensions", keys->format ? keys->format : "B", keys->ndim);
        return -1;
    }
    return 0;
}

/* The copy named by obj: 0 or 1 (or -1, "none", where allow_both); -2 with an exception
 * set. */
static int col_arg(PyObject *obj, const char *what, int allow_both) {
    long c = PyLong_AsLong(obj);
    if (c == -1 && PyErr_Occurred())
        return -2;
    if (c == 0 || c == 1 || (allow_both && c == -1))
        return (int)c;
    PyErr_Format(PyExc_ValueError, "%s: expected 0 or 1%s, got %ld", what,
                 allow_both ? " (or -1: none)" : "", c);
    return -2;
}

/* out is a writable 1-D array of n items of itemsize bytes and an integer code. */
static int int_out(const Py_buffer *out, Py_ssize_t n, Py_ssize_t itemsize, const char *what) {
    char oc = code_of(out);
    int ok = out->itemsize == itemsize && out->len == n * itemsize &&
             (itemsize == 8 ? is_int64(out) : (oc == 'i' || oc == 'l'));
    if (!ok)
        PyErr_Format(PyExc_ValueError, "%s: expected int%zd [%zd], got %zd bytes of format %s",
                     what, itemsize * 8, n, out->len, out->format ? out->format : "B");
    return ok ? 0 : -1;
}

static PyObject *read_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "read_rows(hdr, tab, rows, s, keys, out, nogil): 7 arguments");
        return NULL;
    }
    long long s = PyLong_AsLongLong(args[3]);
    if (s == -1 && PyErr_Occurred())
        return NULL;
    int nogil = PyObject_IsTrue(args[6]);
    if (nogil < 0)
        return NULL;
    Py_buffer hdr, tab, rows, keys, out;
    int got = 0, ret = -1;
    Index ix;
    Rows r;
    if (get_buf(args[0], &hdr, 0, "hdr") < 0) goto done;
    got = 1;
    if (get_buf(args[1], &tab, 0, "tab") < 0) goto done;
    got = 2;
    if (get_buf(args[2], &rows, 0, "rows") < 0) goto done;
    got = 3;
    if (get_buf(args[4], &keys, 0, "keys") < 0) goto done;
    got = 4;
    if (get_buf(args[5], &out, 1, "out") < 0) goto done;
    got = 5;
    if (!is_int64(&hdr) || hdr.len < (H_PREP + 1) * 8) {
        PyErr_SetString(PyExc_ValueError, "hdr: expected the int64 header words of a table");
        goto done;
    }
    if (index_of(&tab, &ix) < 0 || keys_of(&keys) < 0)
        goto done;
    char rc = code_of(&rows);
    if (rows.ndim != 2 ||
            !((rc == 'f' && rows.itemsize == 4) || (rc == 'e' && rows.itemsize == 2))) {
        PyErr_Format(PyExc_ValueError, "rows: expected a 2-D float32 or float16 array, got "
                     "format %s with %d dimensions", rows.format ? rows.format : "B", rows.ndim);
        goto done;
    }
    Py_ssize_t n = keys.len / 8;
    r.base = (const char *)rows.buf;
    r.nrows = rows.shape[0];
    r.dim = rows.shape[1];
    r.row_bytes = r.dim * rows.itemsize;
    r.half = rc == 'e';
    if (code_of(&out) != 'f' || out.itemsize != 4 || out.len != n * r.dim * 4) {
        PyErr_Format(PyExc_ValueError, "out: expected float32 [%zd, %zd], got %zd bytes of "
                     "format %s", n, r.dim, out.len, out.format ? out.format : "B");
        goto done;
    }
    const volatile int64_t *h = (const int64_t *)hdr.buf;
    int bad;
    if (nogil) {
        Py_BEGIN_ALLOW_THREADS
        bad = gather(&ix, (int)(s & 1), &r, (const int64_t *)keys.buf, n, (float *)out.buf);
        Py_END_ALLOW_THREADS
    } else {
        bad = gather(&ix, (int)(s & 1), &r, (const int64_t *)keys.buf, n, (float *)out.buf);
    }
    ACQUIRE_FENCE();  /* every row was read before H_PREP is */
    ret = h[H_PREP] > s + 1 ? 0 : (bad ? 2 : 1);
done:
    if (got >= 5) PyBuffer_Release(&out);
    if (got >= 4) PyBuffer_Release(&keys);
    if (got >= 3) PyBuffer_Release(&rows);
    if (got >= 2) PyBuffer_Release(&tab);
    if (got >= 1) PyBuffer_Release(&hdr);
    return ret < 0 ? NULL : PyLong_FromLong(ret);
}

static PyObject *lookup_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "lookup_slots(tab, keys, col, out, nogil): 5 arguments");
        return NULL;
    }
    int col = col_arg(args[2], "col", 0);
    if (col < -1)
        return NULL;
    int nogil = PyObject_IsTrue(args[4]);
    if (nogil < 0)
        return NULL;
    Py_buffer tab, keys, out;
    int got = 0, ok = 0;
    Index ix;
    if (get_buf(args[0], &tab, 0, "tab") < 0) goto done;
    got = 1;
    if (get_buf(args[1], &keys, 0, "keys") < 0) goto done;
    got = 2;
    if (get_buf(args[3], &out, 1, "out") < 0) goto done;
    got = 3;
    if (index_of(&tab, &ix) < 0 || keys_of(&keys) < 0)
        goto done;
    Py_ssize_t n = keys.len / 8;
    if (int_out(&out, n, 4, "out") < 0)
        goto done;
    if (nogil) {
        Py_BEGIN_ALLOW_THREADS
        slots_of(&ix, col, (const int64_t *)keys.buf, n, (int32_t *)out.buf);
        Py_END_ALLOW_THREADS
    } else {
        slots_of(&ix, col, (const int64_t *)keys.buf, n, (int32_t *)out.buf);
    }
    ok = 1;
done:
    if (got >= 3) PyBuffer_Release(&out);
    if (got >= 2) PyBuffer_Release(&keys);
    if (got >= 1) PyBuffer_Release(&tab);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *index_find(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "index_find(tab, keys, col, pos, slot, nogil): 6 "
                        "arguments");
        return NULL;
    }
    int col = col_arg(args[2], "col", 0);
    if (col < -1)
        return NULL;
    int nogil = PyObject_IsTrue(args[5]);
    if (nogil < 0)
        return NULL;
    Py_buffer tab, keys, pos, slot;
    int got = 0, ok = 0;
    Index ix;
    if (get_buf(args[0], &tab, 0, "tab") < 0) goto done;
    got = 1;
    if (get_buf(args[1], &keys, 0, "keys") < 0) goto done;
    got = 2;
    if (get_buf(args[3], &pos, 1, "pos") < 0) goto done;
    got = 3;
    if (get_buf(args[4], &slot, 1, "slot") < 0) goto done;
    got = 4;
    if (index_of(&tab, &ix) < 0 || keys_of(&keys) < 0)
        goto done;
    Py_ssize_t n = keys.len / 8;
    if (int_out(&pos, n, 8, "pos") < 0 || int_out(&slot, n, 4, "slot") < 0)
        goto done;
    if (nogil) {
        Py_BEGIN_ALLOW_THREADS
        find_all(&ix, col, (const int64_t *)keys.buf, n, (int64_t *)pos.buf,
                 (int32_t *)slot.buf);
        Py_END_ALLOW_THREADS
    } else {
        find_all(&ix, col, (const int64_t *)keys.buf, n, (int64_t *)pos.buf,
                 (int32_t *)slot.buf);
    }
    ok = 1;
done:
    if (got >= 4) PyBuffer_Release(&slot);
    if (got >= 3) PyBuffer_Release(&pos);
    if (got >= 2) PyBuffer_Release(&keys);
    if (got >= 1) PyBuffer_Release(&tab);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *index_insert(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "index_insert(tab, keys, slots, col, other, pos, "
                        "nogil): 7 arguments");
        return NULL;
    }
    int col = col_arg(args[3], "col", 1), other = col < -1 ? -2 : col_arg(args[4], "other", 1);
    if (col < -1 || other < -1)
        return NULL;
    if (other >= 0 && other == col) {
        PyErr_SetString(PyExc_ValueError, "other: expected the copy not inserted into");
        return NULL;
    }
    int nogil = PyObject_IsTrue(args[6]);
    if (nogil < 0)
        return NULL;
    Py_buffer tab, keys, slots, pos;
    int got = 0;
    Py_ssize_t used = 0;
    PyObject *ret = NULL;
    Index ix;
    if (get_buf(args[0], &tab, 1, "tab") < 0) goto done;
    got = 1;
    if (get_buf(args[1], &keys, 0, "keys") < 0) goto done;
    got = 2;
    if (get_buf(args[2], &slots, 0, "slots") < 0) goto done;
    got = 3;
    if (get_buf(args[5], &pos, 1, "pos") < 0) goto done;
    got = 4;
    if (index_of(&tab, &ix) < 0 || keys_of(&keys) < 0)
        goto done;
    Py_ssize_t n = keys.len / 8;
    if (code_of(&slots) != 'i' || slots.itemsize != 4 || slots.len != n * 4) {
        PyErr_Format(PyExc_ValueError, "slots: expected int32 [%zd], got %zd bytes of format %s",
                     n, slots.len, slots.format ? slots.format : "B");
        goto done;
    }
    if (int_out(&pos, n, 8, "pos") < 0)
        goto done;
    if (nogil) {
        Py_BEGIN_ALLOW_THREADS
        used = insert_all((int64_t *)tab.buf, ix.mask, ix.shift, (const int64_t *)keys.buf,
                          (const int32_t *)slots.buf, n, col, other, (int64_t *)pos.buf);
        Py_END_ALLOW_THREADS
    } else {
        used = insert_all((int64_t *)tab.buf, ix.mask, ix.shift, (const int64_t *)keys.buf,
                          (const int32_t *)slots.buf, n, col, other, (int64_t *)pos.buf);
    }
    if (used < 0)
        PyErr_Format(PyExc_ValueError, "tab: no free bucket for key %zd of %zd (all %llu "
                     "buckets are live)", -1 - used, n, (unsigned long long)ix.mask + 1);
    else
        ret = PyLong_FromSsize_t(used);
done:
    if (got >= 4) PyBuffer_Release(&pos);
    if (got >= 3) PyBuffer_Release(&slots);
    if (got >= 2) PyBuffer_Release(&keys);
    if (got >= 1) PyBuffer_Release(&tab);
    return ret;
}

static PyMethodDef methods[] = {
    {"read_rows", (PyCFunction)(void (*)(void))read_rows, METH_FASTCALL,
     "read_rows(hdr, tab, rows, s, keys, out, nogil) -> 1 valid, 0 retry, 2 corrupt"},
    {"lookup_slots", (PyCFunction)(void (*)(void))lookup_slots, METH_FASTCALL,
     "lookup_slots(tab, keys, col, out, nogil): int32 slots of keys (0: absent) into out"},
    {"index_find", (PyCFunction)(void (*)(void))index_find, METH_FASTCALL,
     "index_find(tab, keys, col, pos, slot, nogil): bucket (-1) and slot (0) of each key"},
    {"index_insert", (PyCFunction)(void (*)(void))index_insert, METH_FASTCALL,
     "index_insert(tab, keys, slots, col, other, pos, nogil) -> buckets newly used"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "native",
    "Lookup path of a serving table in C (see consumers.serving.lookup).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    const char *f16 = "portable";
#ifdef HAVE_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c")) {
        f16_row = f16_row_f16c;
        f16 = "f16c";
    }
#endif
    if (PyModule_AddStringConstant(m, "F16", f16) < 0 ||
            PyModule_AddIntConstant(m, "H_PREP", H_PREP) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
