/* deltastream.tracking.native: the FIRST-row bookkeeping of a CPU table's lookups in C.
 *
 * The numpy twin, and what each argument means, is deltastream/tracking/fresh_rows.py (read
 * it first); a test runs both on the same lookups and compares. The state of a table is one
 * int32 per position, slot[p]: 0 while p was not looked up since the last drain, else 1 +
 * the arena row holding p's row as it was then; and a bit per position, set iff slot[p] !=
 * 0 (1/32 of slot's size: the test of every looked-up id mostly hits the cache, slot is
 * written for new positions only, and a drain scans the bits). Per lookup, one pass over
 * the ids marks each position no earlier lookup of the interval had, gives it the next arena
 * row and copies its row there (from the table or from the lookup's output); per read, one
 * pass over the words of bits that lookups marked (a bit per 64-bit word: a large table's
 * read does not sweep its every bit) yields the marked positions ascending with their
 * arena rows, and clears them. numpy needs a temporary per step for the same work (mask,
 * compression, scatter, gather); here the ids are read once, and the entry of an id and a row are prefetched
 * ahead of their use (the rows of a large table are cache misses: prefetching overlaps
 * them).
 *
 * Rows are opaque bytes (any dtype: f32, f16, bf16, ...; any width): buffers are uint8
 * views, a row is row_bytes bytes.
 *
 * Python API (buffers: C-contiguous, e.g. numpy arrays):
 *   mark_fresh(slot, bits, order, ids, src, by_occurrence, row_bytes, arena, used[, words])
 *       -> used'
 *       slot: writable int32 [capacity], bits: writable uint8 [ceil(capacity / 8)] (bit
 *       p & 7 of byte p >> 3 for position p), words (optional): writable uint8, a bit per
 *       64-bit word of bits ([ceil(ceil(capacity / 64) / 8)]; bit w & 7 of byte w >> 3 set
 *       when word w of bits may hold a set bit: set here with every bit it covers), order:
 *       writable int64 [>= used + n], ids: int32 or int64 [n], src: uint8 rows of row_bytes or None, arena: writable uint8
 *       [rows * row_bytes] (rows >= used + n) or None (with src None); used + n < 2**31 -
 *       1. Each id whose bit
 *       is clear gets its bit, slot[id] = used' + 1, order[used'] = id (then used' += 1) and,
 *       with src, a row copied to arena row used': src row id (src: the table,
 *       [capacity * row_bytes]) or, with by_occurrence, src row i for ids[i] (src: the
 *       lookup's output, [n * row_bytes]). An id outside [0, capacity) is an IndexError
 *       naming it, raised before anything is written.
 *   mark_fresh_later, walk_owed_later, hold_lane, lane_jobs: native_later.c (mark_fresh and walk_owed
 *       run on a background thread while the caller goes on).
 *   drain_marked(slot, bits, arena, out_ids, out_rows[, out_at[, words[, keys,
 *                out_keys]]]) -> k
 *       out_ids: writable int64 [m] (m >= the marked positions), out_rows: writable uint8
 *       [m * row_bytes] or None (with arena None). Writes the k marked positions ascending
 *       and, with an arena, each one's arena row; with out_at (writable int64 [m], arena
 *       None), the index of each one's arena row instead; then clears slot and bits. A set
 *       bit whose slot names no arena row is a ValueError
 *       (everything left as it was). With words (mark_fresh's), only the words of bits it
 *       names are read, and words is cleared: the work follows the positions
 *       marked, not the capacity (a 10M-row table's bits are 1.25 MB; its words 20 KB).
 *       With keys (int64, the id held at each position: a hash table's) and out_keys
 *       (writable int64 like out_ids), out_keys[j] = keys[out_ids[j]]: the ids come out of
 *       the same pass (a marked position past keys is a ValueError, nothing changed).
 *   drain_by_key(slot, bits, order, used, keys, arena, out_keys, out_pos, out_rows) -> k
 *       For a table whose ids are not its positions (a hash table): keys: int64 [capacity],
 *       the id held at each position; out_keys, out_pos: writable int64 [>= used];
 *       out_rows: writable uint8 [>= used * row_bytes] or None (with arena None). Writes
 *       the k marked positions' ids ascending, their positions and (with an arena) their
 *       arena rows in that order; then clears their slots and bits. The work follows the
 *       `used` arena rows written, not the capacity: an LSD radix sort of (id, arena row)
 *       pairs, 11 bits a pass, passes whose digit is the same for every id skipped.
 *   capture_owed, walk_owed: native_owed.c (the rows a hand-off owes, and the walk of its
 *       handed-over marks).
 *   merge_sorted: native_sorted.c (the union of two ascending id sets in one pass).
 */
#include "native_tracking.h"
#include "../native_rows.h"

#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "drain_marked reads the bits as little-endian words"
#endif

#define MARK_AHEAD 32 /* ids between the prefetch of an id's slot entry and its test */

/* The ids are taken CHUNK at a time: the marking pass collects the chunk's new positions,
 * then their rows are copied with prefetching (only new rows: a repeat's row is not
 * fetched at all), streamed to the arena: nothing reads it before the hand-off, and
 * ordinary stores first read each arena line in and then hold the cache the training step
 * needs (the C marking 0.095 -> 0.067 ms a step at two tables with rounds every 10 steps,
 * 0.89 -> 0.75 ms at 26 tables; BENCHMARKS.md, stop 64). */
#define CHUNK 512

#define MARK_LOOP(T)                                                                     \
    do {                                                                                 \
        const T *q = (const T *)m->ids;                                                  \
        int64_t from[CHUNK];                                                             \
        for (Py_ssize_t lo = 0; lo < n; lo += CHUNK) {                                   \
            Py_ssize_t hi = lo + CHUNK < n ? lo + CHUNK : n, k = 0;                      \
            for (Py_ssize_t i = lo; i < hi; i++) {                                       \
                if (i + MARK_AHEAD < n)                                                  \
                    PREFETCH(bt + ((uint64_t)q[i + MARK_AHEAD] >> 3));                   \
                uint64_t p = (uint64_t)q[i];                                             \
                uint8_t bit = (uint8_t)(1u << (p & 7));                                  \
                if (bt[p >> 3] & bit)                                                    \
                    continue;                                                            \
                bt[p >> 3] |= bit;                                                       \
                if (wd != NULL)                                                          \
                    wd[p >> 9] |= (uint8_t)(1u << ((p >> 6) & 7));                       \
                s[p] = (int32_t)(used + k + 1);                                          \
                o[used + k] = (int64_t)p;                                                \
                from[k++] = m->by_occurrence ? (int64_t)i : (int64_t)p;                  \
            }                                                                            \
            if (m->w != NULL)                                                            \
                move_rows_at(m->a + (uint64_t)used * m->rb, NULL, m->w, from, k,         \
                             m->rb, 1); /* streamed: the arena */                        \
            used += k;                                                                   \
        }                                                                                \
    } while (0)

/* Mark m's ids (see mark_fresh); returns the new used. */
Py_ssize_t mark_run(const Mark *m) {
    Py_ssize_t n = m->n, used = m->used;
    uint8_t *bt = m->bt, *wd = m->wd;
    int32_t *s = m->s;
    int64_t *o = m->o;
    if (m->wide)
        MARK_LOOP(int64_t);
    else
        MARK_LOOP(int32_t);
#if defined(__SSE2__)
    _mm_sfence(); /* the streamed rows are visible before anyone reads them */
#endif
    return used;
}

/* mark_fresh's arguments taken into bs and checked into m; -1 with an error set. */
int mark_setup(PyObject *args, Bufs *bs, Mark *m) {
    PyObject *o_slot, *o_bits, *o_order, *o_ids, *o_src, *o_arena, *o_words = Py_None;
    int by_occurrence;
    Py_ssize_t used, rb;
    if (!PyArg_ParseTuple(args, "OOOOOpnOn|O", &o_slot, &o_bits, &o_order, &o_ids, &o_src,
                          &by_occurrence, &rb, &o_arena, &used, &o_words))
        return -1;
    Py_buffer *slot = take(bs, o_slot, 1, "slot");
    Py_buffer *bits = slot == BAD ? NULL : take(bs, o_bits, 1, "bits");
    Py_buffer *order = bits == BAD ? NULL : take(bs, o_order, 1, "order");
    Py_buffer *ids = order == BAD ? NULL : take(bs, o_ids, 0, "ids");
    Py_buffer *src = ids == BAD ? NULL : take(bs, o_src, 0, "src");
    Py_buffer *arena = src == BAD ? NULL : take(bs, o_arena, 1, "arena");
    Py_buffer *words = arena == BAD ? NULL : take(bs, o_words, 1, "words");
    if (slot == BAD || bits == BAD || order == BAD || ids == BAD || src == BAD ||
        arena == BAD || words == BAD)
        return -1;
    if (!slot || !bits || !order || !ids) {
        PyErr_SetString(PyExc_TypeError, "slot, bits, order and ids are required");
        return -1;
    }
    if (check_item(slot, 4, "i", "slot") < 0 || check_item(order, 8, "ql", "order") < 0 ||
        check_bits(bits, slot->len / 4) < 0 || check_words(words, bits->len) < 0)
        return -1;
    int wide = ids->itemsize == 8;
    if (check_item(ids, wide ? 8 : 4, wide ? "ql" : "i", "ids") < 0)
        return -1;
    Py_ssize_t cap = slot->len / 4, n = ids->len / ids->itemsize;
    *m = (Mark){.ids = ids->buf, .wide = wide, .by_occurrence = by_occurrence, .n = n,
                .used = used, .rb = rb, .bt = (uint8_t *)bits->buf,
                .wd = words ? (uint8_t *)words->buf : NULL,
                .a = arena ? (uint8_t *)arena->buf : NULL, .s = (int32_t *)slot->buf,
                .o = (int64_t *)order->buf, .w = src ? (const uint8_t *)src->buf : NULL};
    if (n == 0)
        return 0;
    if (used < 0 || used + n >= INT32_MAX || order->len / 8 < used + n) {
        PyErr_Format(PyExc_ValueError, "order: %zd entries for %zd + %zd rows (at most 2**31 - "
                     "2)", order->len / 8, used, n);
        return -1;
    }
    if ((src == NULL) != (arena == NULL)) {
        PyErr_SetString(PyExc_ValueError, "src and arena: both or neither");
        return -1;
    }
    if (src != NULL) {
        Py_ssize_t src_rows = by_occurrence ? n : cap;
        if (rb <= 0 || src->len / rb < src_rows) {
            PyErr_Format(PyExc_ValueError, "src: %zd bytes do not hold %zd rows of %zd bytes",
                         src->len, src_rows, rb);
            return -1;
        }
        if (arena->len % rb || arena->len / rb < used + n) {
            PyErr_Format(PyExc_ValueError, "arena: %zd bytes do not hold %zd rows of %zd bytes",
                         arena->len, used + n, rb);
            return -1;
        }
    }
    return check_ids(ids->buf, wide, n, (uint64_t)cap, "lookup", " id", "the table's rows ");
}

static PyObject *mark_fresh(PyObject *self, PyObject *args) {
    Bufs bs = {.n = 0};
    Mark m;
    PyObject *ret = mark_setup(args, &bs, &m) < 0 ? NULL : PyLong_FromSsize_t(mark_run(&m));
    release(&bs);
    return ret;
}

/* The arena read in order, arena row i streamed to output row dest[i] (skipped when
 * dest[i] < 0): sequential reads, and writes that do not pull the output's lines in. */
static void scatter_arena(uint8_t *out, const uint8_t *arena, const int64_t *dest, Py_ssize_t n,
                          Py_ssize_t rb) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (dest[i] >= 0)
            put_row(out + dest[i] * rb, arena + i * rb, rb);
#if defined(__SSE2__)
    _mm_sfence(); /* the streamed rows are visible before the caller reads them */
#endif
}

static PyObject *drain_marked(PyObject *self, PyObject *args) {
    PyObject *o_slot, *o_bits, *o_arena, *o_ids, *o_rows, *o_at = Py_None;
    PyObject *o_words = Py_None, *o_keys = Py_None, *o_out_keys = Py_None;
    if (!PyArg_ParseTuple(args, "OOOOO|OOOO", &o_slot, &o_bits, &o_arena, &o_ids, &o_rows,
                          &o_at, &o_words, &o_keys, &o_out_keys))
        return NULL;
    Bufs bs = {.n = 0};
    PyObject *ret = NULL;
    int64_t *dest = NULL;
    Py_buffer *slot = take(&bs, o_slot, 1, "slot");
    Py_buffer *bits = slot == BAD ? NULL : take(&bs, o_bits, 1, "bits");
    Py_buffer *arena = bits == BAD ? NULL : take(&bs, o_arena, 0, "arena");
    Py_buffer *out = arena == BAD ? NULL : take(&bs, o_ids, 1, "out_ids");
    Py_buffer *rows = out == BAD ? NULL : take(&bs, o_rows, 1, "out_rows");
    Py_buffer *ats = rows == BAD ? NULL : take(&bs, o_at, 1, "out_at");
    Py_buffer *words = ats == BAD ? NULL : take(&bs, o_words, 1, "words");
    Py_buffer *keys = words == BAD ? NULL : take(&bs, o_keys, 0, "keys");
    Py_buffer *okeys = keys == BAD ? NULL : take(&bs, o_out_keys, 1, "out_keys");
    if (slot == BAD || bits == BAD || arena == BAD || out == BAD || rows == BAD || ats == BAD ||
        words == BAD || keys == BAD || okeys == BAD)
        goto done;
    if (!slot || !bits || !out) {
        PyErr_SetString(PyExc_TypeError, "slot, bits and out_ids are required");
        goto done;
    }
    if (check_item(slot, 4, "i", "slot") < 0 || check_item(out, 8, "ql", "out_ids") < 0 ||
        check_bits(bits, slot->len / 4) < 0 || check_words(words, bits->len) < 0)
        goto done;
    /* m_out = the arena rows written (the caller's used): every slot names one of them */
    Py_ssize_t m_out = out->len / 8, rb = 0;
    if ((arena == NULL) != (rows == NULL)) {
        PyErr_SetString(PyExc_ValueError, "arena and out_rows: both or neither");
        goto done;
    }
    if (ats != NULL && (arena != NULL || check_item(ats, 8, "ql", "out_at") < 0 ||
                        ats->len != out->len)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "out_at: int64 as long as out_ids, no arena");
        goto done;
    }
    int64_t *at_out = ats ? (int64_t *)ats->buf : NULL;
    if ((keys == NULL) != (okeys == NULL) ||
        (keys != NULL && (check_item(keys, 8, "ql", "keys") < 0 ||
                          check_item(okeys, 8, "ql", "out_keys") < 0 ||
                          okeys->len != out->len))) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "keys and out_keys: both or neither; out_keys "
                            "int64 as long as out_ids");
        goto done;
    }
    const int64_t *kin = keys ? (const int64_t *)keys->buf : NULL;
    Py_ssize_t n_keys = keys ? keys->len / 8 : 0;
    if (arena != NULL) {
        rb = m_out ? rows->len / m_out : 0;
        if (m_out == 0 || rb == 0 || rows->len != m_out * rb || arena->len % rb ||
            arena->len / rb < m_out) {
            PyErr_Format(PyExc_ValueError, "out_rows: %zd bytes are not %zd rows (arena %zd "
                         "bytes)", rows->len, m_out, arena->len);
            goto done;
        }
        dest = (int64_t *)PyMem_Malloc((size_t)(m_out ? m_out : 1) * sizeof(int64_t));
        if (dest == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        memset(dest, 0xff, (size_t)m_out * sizeof(int64_t)); /* -1: no position's row */
    }
    int32_t *s = (int32_t *)slot->buf;
    uint8_t *bt = (uint8_t *)bits->buf;
    int64_t *o = (int64_t *)out->buf;
    /* the set bits in order (64 positions per word, only the words that words names when
     * given): position j of the output, and the output row of each arena row; nothing is
     * cleared before every entry proved valid */
    Py_ssize_t j = 0, nb = bits->len, nw = (nb + 7) / 8;
    uint8_t *wd = words ? (uint8_t *)words->buf : NULL;
    for (Py_ssize_t w = 0; w < nw; w++) {
        if (wd != NULL) {
            if (!wd[w >> 3]) { /* 8 words (512 positions) with nothing set */
                w |= 7;
                continue;
            }
            if (!(wd[w >> 3] & (1u << (w & 7))))
                continue;
        }
        Py_ssize_t b = w * 8;
        uint64_t word = 0;
        memcpy(&word, bt + b, nb - b < 8 ? (size_t)(nb - b) : 8); /* little-endian bit order */
        while (word) {
            Py_ssize_t p = b * 8 + __builtin_ctzll(word);
            word &= word - 1;
            int64_t at = (int64_t)s[p] - 1; /* a set bit over a 0 slot is -1 */
            if (j >= m_out || at < 0 || at >= m_out || (dest != NULL && dest[at] >= 0)) {
                PyErr_Format(PyExc_ValueError, "slot of position %zd names arena row %lld: "
                             "not one of the %zd rows written, or another position's", p,
                             (long long)at, m_out);
                goto done;
            }
            if (kin != NULL && p >= n_keys) {
                PyErr_Format(PyExc_ValueError, "keys: position %zd is marked, keys has %zd",
                             p, n_keys);
                goto done;
            }
            if (dest != NULL)
                dest[at] = j;
            if (at_out != NULL)
                at_out[j] = at;
            o[j++] = p;
        }
    }
    if (dest != NULL)
        scatter_arena((uint8_t *)rows->buf, (const uint8_t *)arena->buf, dest, m_out, rb);
    /* every entry proved valid: one pass over the positions output (ascending, so the
     * arrays indexed by position are read and written in order) */
    int64_t *ko = okeys ? (int64_t *)okeys->buf : NULL;
    for (Py_ssize_t i = 0; i < j; i++) {
        int64_t p = o[i];
        s[p] = 0; /* every set bit was output: clear its byte */
        bt[p >> 3] = 0;
        if (ko != NULL)
            ko[i] = kin[p];
    }
    if (wd != NULL)
        memset(wd, 0, (size_t)words->len);
    ret = PyLong_FromSsize_t(j);
done:
    PyMem_Free(dest);
    release(&bs);
    return ret;
}

/* LSD radix sort of n (key, value) pairs by key, ascending and stable: 11-bit digits of
 * key - min (every pass a stable counting sort; the counts of every digit taken in one read
 * of the keys), a pass skipped when all keys share its digit. k/v and tk/tv are ping-pong
 * buffers of n entries; count holds RADIX_PASSES * RADIX_SIZE entries. Returns 1 when the
 * result is in tk/tv, 0 when in k/v. */
#define RADIX_BITS 11
#define RADIX_SIZE (1 << RADIX_BITS)
#define RADIX_PASSES ((64 + RADIX_BITS - 1) / RADIX_BITS)
static int radix_pairs(uint64_t *k, int64_t *v, uint64_t *tk, int64_t *tv, Py_ssize_t n,
                       Py_ssize_t *count) {
    if (n < 2)
        return 0;
    uint64_t lo = UINT64_MAX, hi = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        lo = k[i] < lo ? k[i] : lo;
        hi = k[i] > hi ? k[i] : hi;
    }
    uint64_t span = hi - lo;
    int passes = 1;
    while (passes < RADIX_PASSES && (span >> (passes * RADIX_BITS)))
        passes++;
    memset(count, 0, (size_t)passes * RADIX_SIZE * sizeof *count);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t x = k[i] - lo;
        for (int d = 0; d < passes; d++)
            count[d * RADIX_SIZE + ((x >> (d * RADIX_BITS)) & (RADIX_SIZE - 1))]++;
    }
    int swapped = 0;
    for (int d = 0; d < passes; d++) {
        Py_ssize_t *c = count + d * RADIX_SIZE;
        int shift = d * RADIX_BITS;
        if (c[((k[0] - lo) >> shift) & (RADIX_SIZE - 1)] == n)
            continue; /* one digit for every key: the pass would not move anything */
        Py_ssize_t at = 0;
        for (int b = 0; b < RADIX_SIZE; b++) {
            Py_ssize_t m = c[b];
            c[b] = at;
            at += m;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t to = c[((k[i] - lo) >> shift) & (RADIX_SIZE - 1)]++;
            tk[to] = k[i];
            tv[to] = v[i];
        }
        uint64_t *sk = k;
        int64_t *sv = v;
        k = tk, v = tv, tk = sk, tv = sv;
        swapped ^= 1;
    }
    return swapped;
}

static PyObject *drain_by_key(PyObject *self, PyObject *args) {
    PyObject *o_slot, *o_bits, *o_order, *o_keys, *o_arena, *o_okeys, *o_opos, *o_rows;
    Py_ssize_t used;
    if (!PyArg_ParseTuple(args, "OOOnOOOOO", &o_slot, &o_bits, &o_order, &used, &o_keys,
                          &o_arena, &o_okeys, &o_opos, &o_rows))
        return NULL;
    PyObject *ret = NULL;
    uint64_t *kb = NULL;
    int64_t *vb = NULL;
    Bufs bs = {.n = 0};
    Py_buffer *slot = take(&bs, o_slot, 1, "slot");
    Py_buffer *bits = slot == BAD ? NULL : take(&bs, o_bits, 1, "bits");
    Py_buffer *order = bits == BAD ? NULL : take(&bs, o_order, 0, "order");
    Py_buffer *keys = order == BAD ? NULL : take(&bs, o_keys, 0, "keys");
    Py_buffer *arena = keys == BAD ? NULL : take(&bs, o_arena, 0, "arena");
    Py_buffer *okeys = arena == BAD ? NULL : take(&bs, o_okeys, 1, "out_keys");
    Py_buffer *opos = okeys == BAD ? NULL : take(&bs, o_opos, 1, "out_pos");
    Py_buffer *rows = opos == BAD ? NULL : take(&bs, o_rows, 1, "out_rows");
    if (slot == BAD || bits == BAD || order == BAD || keys == BAD || arena == BAD ||
        okeys == BAD || opos == BAD || rows == BAD)
        goto done;
    if (!slot || !bits || !order || !keys || !okeys || !opos) {
        PyErr_SetString(PyExc_TypeError, "slot, bits, order, keys, out_keys and out_pos are "
                        "required");
        goto done;
    }
    if (check_item(slot, 4, "i", "slot") < 0 || check_item(order, 8, "ql", "order") < 0 ||
        check_item(keys, 8, "ql", "keys") < 0 || check_item(okeys, 8, "ql", "out_keys") < 0 ||
        check_item(opos, 8, "ql", "out_pos") < 0 || check_bits(bits, slot->len / 4) < 0)
        goto done;
    Py_ssize_t cap = slot->len / 4, rb = 0;
    if (used < 0 || order->len / 8 < used || okeys->len / 8 < used || opos->len / 8 < used ||
        keys->len / 8 < cap) {
        PyErr_Format(PyExc_ValueError, "order, out_keys, out_pos: fewer than %zd entries, or "
                     "keys: fewer than %zd", used, cap);
        goto done;
    }
    if ((arena == NULL) != (rows == NULL)) {
        PyErr_SetString(PyExc_ValueError, "arena and out_rows: both or neither");
        goto done;
    }
    if (arena != NULL && used > 0) {
        rb = rows->len / used;
        if (rb == 0 || arena->len % rb || arena->len / rb < used) {
            PyErr_Format(PyExc_ValueError, "out_rows: %zd bytes are not %zd rows (arena %zd "
                         "bytes)", rows->len, used, arena->len);
            goto done;
        }
    }
    if (used == 0) {
        ret = PyLong_FromSsize_t(0);
        goto done;
    }
    kb = (uint64_t *)PyMem_Malloc((size_t)used * 2 * sizeof(uint64_t));
    vb = (int64_t *)PyMem_Malloc((size_t)used * 2 * sizeof(int64_t));
    Py_ssize_t *count = (Py_ssize_t *)PyMem_Malloc(RADIX_PASSES * RADIX_SIZE *
                                                    sizeof(Py_ssize_t));
    if (kb == NULL || vb == NULL || count == NULL) {
        PyMem_Free(count);
        PyErr_NoMemory();
        goto done;
    }
    int32_t *s = (int32_t *)slot->buf;
    const int64_t *o = (const int64_t *)order->buf, *key = (const int64_t *)keys->buf;
    for (Py_ssize_t a = 0; a < used; a++) /* checked first: nothing changes on an error */
        if ((uint64_t)o[a] >= (uint64_t)cap) {
            PyMem_Free(count);
            PyErr_Format(PyExc_ValueError, "order: arena row %zd names position %lld, outside "
                         "[0, %zd)", a, (long long)o[a], cap);
            goto done;
        }
    /* the arena rows that hold their position's row (numpy may have left earlier copies of a
     * position: its slot names the last one), with the id there; their marks are cleared
     * while the entry is in the cache (a marked position's byte of bits has no other
     * position left marked once the pass is over) */
    uint8_t *bt = (uint8_t *)bits->buf;
    Py_ssize_t n = 0;
    for (Py_ssize_t a = 0; a < used; a++) {
        if (a + MARK_AHEAD < used) {
            PREFETCH_W(s + o[a + MARK_AHEAD]);
            PREFETCH(key + o[a + MARK_AHEAD]);
        }
        int64_t p = o[a];
        if ((int64_t)s[p] != (int64_t)a + 1)
            continue;
        s[p] = 0;
        bt[p >> 3] = 0;
        kb[n] = (uint64_t)key[p] ^ ((uint64_t)1 << 63); /* int64 order as unsigned order */
        vb[n++] = a;
    }
    int in_tmp = radix_pairs(kb, vb, kb + used, vb + used, n, count);
    PyMem_Free(count);
    const uint64_t *sk = in_tmp ? kb + used : kb;
    const int64_t *sv = in_tmp ? vb + used : vb;
    /* the free half of the key buffer becomes each arena row's output row (-1: none) */
    int64_t *dest = (int64_t *)(in_tmp ? kb : kb + used);
    int64_t *ok = (int64_t *)okeys->buf, *op = (int64_t *)opos->buf;
    if (rows != NULL)
        memset(dest, 0xff, (size_t)used * sizeof(int64_t));
    for (Py_ssize_t i = 0; i < n; i++) {
        ok[i] = (int64_t)(sk[i] ^ ((uint64_t)1 << 63));
        op[i] = o[sv[i]];
        if (rows != NULL)
            dest[sv[i]] = i;
    }
    if (rows != NULL)
        scatter_arena((uint8_t *)rows->buf, (const uint8_t *)arena->buf, dest, used, rb);
    ret = PyLong_FromSsize_t(n);
done:
    PyMem_Free(kb);
    PyMem_Free(vb);
    release(&bs);
    return ret;
}

static PyObject *gather_rows(PyObject *self, PyObject *args) {
    PyObject *o_src, *o_at, *o_out;
    Py_ssize_t rb;
    if (!PyArg_ParseTuple(args, "OOOn", &o_src, &o_at, &o_out, &rb))
        return NULL;
    Bufs bs = {.n = 0};
    PyObject *ret = NULL;
    Py_buffer *src = take(&bs, o_src, 0, "src");
    Py_buffer *at = src == BAD ? NULL : take(&bs, o_at, 0, "at");
    Py_buffer *out = at == BAD ? NULL : take(&bs, o_out, 1, "out");
    if (src == BAD || at == BAD || out == BAD)
        goto done;
    if (!src || !at || !out) {
        PyErr_SetString(PyExc_TypeError, "src, at and out are required");
        goto done;
    }
    if (check_item(at, 8, "ql", "at") < 0)
        goto done;
    Py_ssize_t n = at->len / 8, rows = rb > 0 ? src->len / rb : 0;
    if (rb <= 0 || src->len % rb || out->len != n * rb) {
        PyErr_Format(PyExc_ValueError, "out: %zd bytes are not %zd rows of %zd bytes (src %zd "
                     "bytes)", out->len, n, rb, src->len);
        goto done;
    }
    if (check_at(at, rows, "at") < 0)
        goto done;
    const int64_t *q = (const int64_t *)at->buf;
    Py_BEGIN_ALLOW_THREADS
    copy_rows_at((uint8_t *)out->buf, NULL, (const uint8_t *)src->buf, q, n, rb);
    Py_END_ALLOW_THREADS
    ret = PyLong_FromSsize_t(n);
done:
    release(&bs);
    return ret;
}

static PyMethodDef methods[] = {
    {"mark_fresh", mark_fresh, METH_VARARGS,
     "mark_fresh(slot, bits, order, ids, src, by_occurrence, row_bytes, arena, used[, words]) "
     "-> used: "
     "mark new "
     "ids, copy their rows"},
    {"mark_fresh_later", mark_fresh_later, METH_VARARGS,
     "mark_fresh_later(same as mark_fresh) -> Marking: mark_fresh on the lane thread; "
     "Marking.wait() -> used"},
    {"hold_lane", hold_lane, METH_O,
     "hold_lane(on): keep the lane's queued markings waiting (tests)"},
    {"lane_jobs", lane_jobs_done, METH_NOARGS,
     "lane_jobs() -> (by_lane, by_waiters): jobs finished by the lane thread, and by "
     "callers that waited for a job the lane had not started"},
    {"drain_marked", drain_marked, METH_VARARGS,
     "drain_marked(slot, bits, arena, out_ids, out_rows[, out_at[, words[, keys, "
     "out_keys]]]) -> k: "
     "marked positions ascending"},
    {"gather_rows", gather_rows, METH_VARARGS,
     "gather_rows(src, at, out, row_bytes) -> n: out row i = src row at[i]"},
    {"capture_owed", capture_owed, METH_VARARGS,
     "capture_owed(owed, ids, src, by_occurrence, out, row_bytes) -> k: copy owed rows"},
    {"walk_owed", walk_owed, METH_VARARGS,
     "walk_owed(owed, bits, words, word, max_positions, src, early, out, row_bytes, keys, "
     "ids_out, pos_out, at_out, offset, entry) -> (next_word, walked, copied): walk "
     "handed-over marks"},
    {"walk_owed_later", walk_owed_later, METH_VARARGS,
     "walk_owed_later(same arguments as walk_owed) -> Walking: the walk queued on the lane "
     "thread"},
    {"merge_sorted", merge_sorted, METH_VARARGS,
     "merge_sorted(a, b, out, pos_a, b_only, pos_b, in_a, at_a) -> m: the union of two "
     "ascending id sets in one pass (native_sorted.c)"},
    {"drain_by_key", drain_by_key, METH_VARARGS,
     "drain_by_key(slot, bits, order, used, keys, arena, out_keys, out_pos, out_rows) -> k: "
     "marked positions by ascending key"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "native",
                                    "FIRST-row bookkeeping of TorchRec shards on the CPU.",
                                    -1, methods};

PyMODINIT_FUNC PyInit_native(void) {
    if (later_ready() < 0)
        return NULL;
    return PyModule_Create(&module);
}
