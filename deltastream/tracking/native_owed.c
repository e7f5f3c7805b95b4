/* deltastream.tracking.native: the rows a hand-off owes (owed_rows.py, its numpy twin),
 * copied as lookups reach them and as the handed-over marks are walked.
 *
 *   capture_owed(owed, ids, src, by_occurrence, out, row_bytes) -> k
 *       The rows a hand-off still owes (owed_rows.py): owed: writable int32 [capacity], 0
 *       or 1 + the row of out that position p's current row goes to; ids: int32 or int64
 *       positions [n], each < capacity; src: rows of row_bytes, row ids[i] (the table) or
 *       with by_occurrence row i (a lookup's output, [n]); out: writable. Each owed id has
 *       its src row copied to out and its entry negated (-(1 + row): captured, its row
 *       still known to walk_owed); k: rows copied. Every id and owed entry is checked
 *       before anything is written (IndexError / ValueError).
 *   walk_owed(owed, bits, words, word, max_positions, src, early, out, row_bytes, keys,
 *             ids_out, pos_out, at_out, offset, entry) -> (next_word, walked, copied)
 *       The walk of a hand-off's handed-over marks (owed_rows.py): from 64-bit word `word`
 *       of bits (the words words names only), whole words until max_positions set bits
 *       were walked or none is left; output from entry `entry` on, one per position, in
 *       position order. Each set bit's position p, r = |owed[p]| - 1: out's entry is src
 *       row p when owed (owed[p] > 0), else early row r (where capture_owed copied it);
 *       pos_out = p, at_out = r, ids_out = keys[p] (keys: int64, the id at each position)
 *       or without keys p + offset; owed[p] and the bits walked are cleared. out holds one
 *       row per entry, early at least as many (one per arena row: a mark forgotten when
 *       its row was freed leaves its arena row unnamed). A bit whose entry names no row is
 *       a ValueError (the words before it stay walked).
 */
#include "native_tracking.h"
#include "../native_rows.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

/* Wait until owed entry *e is no longer CLAIMED (the lane thread's walk is copying that row
 * from the storage: a copy of one row). A spin first; then short sleeps, which leave this
 * core to the lane thread (SCHED_IDLE: a yield would not let it run here if it was
 * preempted mid-copy). */
static void wait_unclaimed(int32_t *e) {
    const struct timespec pause = {.tv_sec = 0, .tv_nsec = 20000};
    for (unsigned spins = 0; __atomic_load_n(e, __ATOMIC_ACQUIRE) == CLAIMED; spins++)
        if (spins > 64)
            nanosleep(&pause, NULL);
}

#define MARK_AHEAD 32 /* ids between the prefetch of an id's owed entry and its test */

PyObject *capture_owed(PyObject *self, PyObject *args) {
    PyObject *o_owed, *o_ids, *o_src, *o_out;
    int by_occurrence;
    Py_ssize_t rb;
    if (!PyArg_ParseTuple(args, "OOOpOn", &o_owed, &o_ids, &o_src, &by_occurrence, &o_out,
                          &rb))
        return NULL;
    Bufs bs = {.n = 0};
    PyObject *ret = NULL;
    Py_buffer *owed = take(&bs, o_owed, 1, "owed");
    Py_buffer *ids = owed == BAD ? NULL : take(&bs, o_ids, 0, "ids");
    Py_buffer *src = ids == BAD ? NULL : take(&bs, o_src, 0, "src");
    Py_buffer *out = src == BAD ? NULL : take(&bs, o_out, 1, "out");
    if (owed == BAD || ids == BAD || src == BAD || out == BAD)
        goto done;
    if (!owed || !ids || !src || !out) {
        PyErr_SetString(PyExc_TypeError, "owed, ids, src and out are required");
        goto done;
    }
    int wide = ids->itemsize == 8;
    if (check_item(owed, 4, "i", "owed") < 0 ||
        check_item(ids, wide ? 8 : 4, wide ? "ql" : "i", "ids") < 0)
        goto done;
    Py_ssize_t cap = owed->len / 4, n = ids->len / ids->itemsize;
    if (rb <= 0 || src->len % rb || out->len % rb ||
        src->len / rb < (by_occurrence ? n : 0)) {
        PyErr_Format(PyExc_ValueError, "src (%zd bytes) and out (%zd bytes) are not rows of "
                     "%zd bytes%s", src->len, out->len, rb,
                     by_occurrence ? ", one src row per id" : "");
        goto done;
    }
    Py_ssize_t src_rows = src->len / rb, rows = out->len / rb;
    uint64_t lim = (uint64_t)(by_occurrence || src_rows > cap ? cap : src_rows);
    if (check_ids(ids->buf, wide, n, lim, "ids", ": position", "") < 0)
        goto done;
    int32_t *o = (int32_t *)owed->buf;
#define ID_AT(i) (wide ? ((const int64_t *)ids->buf)[i] : (int64_t)((const int32_t *)ids->buf)[i])
    for (Py_ssize_t i = 0; i < n; i++) { /* the owed entries, checked before any write */
        if (i + MARK_AHEAD < n)
            PREFETCH(o + ID_AT(i + MARK_AHEAD));
        int64_t r = (int64_t)__atomic_load_n(o + ID_AT(i), __ATOMIC_RELAXED) - 1;
        if (r >= rows) {
            PyErr_Format(PyExc_ValueError, "owed: position %lld names row %lld of a %zd-row "
                         "out", (long long)ID_AT(i), (long long)r, rows);
            goto done;
        }
    }
    uint8_t *dst = (uint8_t *)out->buf;
    const uint8_t *from = (const uint8_t *)src->buf;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n) { /* the owed entries are cached by the check above */
            const uint8_t *ahead = from + (uint64_t)(by_occurrence ? i + AHEAD : ID_AT(i + AHEAD)) * rb;
            PREFETCH(ahead);
            PREFETCH(ahead + rb - 1);
        }
        int64_t p = ID_AT(i);
        int32_t v = __atomic_load_n(o + p, __ATOMIC_ACQUIRE);
        if (v > 0) { /* owed: the row to early first, then the entry negated (a walk on the
                      * lane thread reads early's row once it sees the negation) */
            copy_row(dst + (uint64_t)(v - 1) * rb, from + (uint64_t)(by_occurrence ? i : p) * rb,
                     rb);
            if (__atomic_compare_exchange_n(o + p, &v, -v, 0, __ATOMIC_ACQ_REL,
                                            __ATOMIC_ACQUIRE)) {
                k++; /* captured; walk_owed still finds its row */
                continue;
            }
        }
        if (v == CLAIMED) /* the walk is copying it from the storage: wait, it is complete */
            wait_unclaimed(o + p);
    }
#undef ID_AT
    ret = PyLong_FromSsize_t(k);
done:
    release(&bs);
    return ret;
}

#define WALK_BATCH 256 /* positions collected (and their rows prefetched) before copies */

int walk_setup(PyObject *args, Bufs *bs, Walk *st) {
    PyObject *o_owed, *o_bits, *o_words, *o_src, *o_early, *o_out, *o_keys, *o_ids, *o_pos;
    PyObject *o_at;
    Py_ssize_t word, max_pos, rb, j;
    long long offset;
    if (!PyArg_ParseTuple(args, "OOOnnOOOnOOOOLn", &o_owed, &o_bits, &o_words, &word, &max_pos,
                          &o_src, &o_early, &o_out, &rb, &o_keys, &o_ids, &o_pos, &o_at,
                          &offset, &j))
        return -1;
    Py_buffer *owed = take(bs, o_owed, 1, "owed");
    Py_buffer *bits = owed == BAD ? NULL : take(bs, o_bits, 1, "bits");
    Py_buffer *words = bits == BAD ? NULL : take(bs, o_words, 1, "words");
    Py_buffer *src = words == BAD ? NULL : take(bs, o_src, 0, "src");
    Py_buffer *early = src == BAD ? NULL : take(bs, o_early, 0, "early");
    Py_buffer *out = early == BAD ? NULL : take(bs, o_out, 1, "out");
    Py_buffer *keys = out == BAD ? NULL : take(bs, o_keys, 0, "keys");
    Py_buffer *ids = keys == BAD ? NULL : take(bs, o_ids, 1, "ids_out");
    Py_buffer *pos = ids == BAD ? NULL : take(bs, o_pos, 1, "pos_out");
    Py_buffer *ats = pos == BAD ? NULL : take(bs, o_at, 1, "at_out");
    if (owed == BAD || bits == BAD || words == BAD || src == BAD || early == BAD || out == BAD ||
        keys == BAD || ids == BAD || pos == BAD || ats == BAD)
        return -1;
    if (!owed || !bits || !words || !src || !early || !out || !ids || !pos || !ats) {
        PyErr_SetString(PyExc_TypeError, "every argument but keys is required");
        return -1;
    }
    if (check_item(owed, 4, "i", "owed") < 0 || check_bits(bits, owed->len / 4) < 0 ||
        check_words(words, bits->len) < 0 || check_item(pos, 8, "ql", "pos_out") < 0 ||
        check_item(ids, 8, "ql", "ids_out") < 0 || check_item(ats, 8, "ql", "at_out") < 0 ||
        (keys != NULL && check_item(keys, 8, "ql", "keys") < 0))
        return -1;
    Py_ssize_t n = pos->len / 8;
    if (ids->len != pos->len || ats->len != pos->len || j < 0 || j > n) {
        PyErr_Format(PyExc_ValueError, "ids_out, pos_out and at_out: %zd entries each (got "
                     "%zd, %zd, %zd), from entry %zd", n, ids->len / 8, pos->len / 8,
                     ats->len / 8, j);
        return -1;
    }
    if (rb <= 0 || src->len % rb || out->len != n * rb || early->len % rb ||
        early->len < n * rb) {
        PyErr_Format(PyExc_ValueError, "src (%zd bytes), early (%zd) and out (%zd) are not "
                     "rows of %zd bytes, out one per entry (%zd), early at least as many",
                     src->len, early->len, out->len, rb, n);
        return -1;
    }
    Py_ssize_t nb = bits->len;
    *st = (Walk){.o = (int32_t *)owed->buf, .bt = (uint8_t *)bits->buf,
                 .wd = (uint8_t *)words->buf, .dst = (uint8_t *)out->buf,
                 .from = (const uint8_t *)src->buf, .ear = (const uint8_t *)early->buf,
                 .kin = keys ? (const int64_t *)keys->buf : NULL, .ko = (int64_t *)ids->buf,
                 .po = (int64_t *)pos->buf, .ao = (int64_t *)ats->buf, .n = n, .nb = nb,
                 .nw = (nb + 7) / 8, .src_rows = src->len / rb, .early_rows = early->len / rb,
                 .n_keys = keys ? keys->len / 8 : 0, .rb = rb, .w = word < 0 ? 0 : word,
                 .j = j, .max_pos = max_pos, .offset = offset};
    return 0;
}

/* One position's row to entry j: the storage's while it is owed (claimed first: a lookup
 * on another thread may be capturing it), else the one a lookup copied early. */
static inline void walk_copy(Walk *st, Py_ssize_t p) {
    int32_t *e = st->o + p;
    int32_t v = __atomic_load_n(e, __ATOMIC_ACQUIRE);
    if (v > 0 && __atomic_compare_exchange_n(e, &v, CLAIMED, 0, __ATOMIC_ACQ_REL,
                                             __ATOMIC_ACQUIRE)) {
        copy_row(st->dst + (uint64_t)st->j * st->rb, st->from + (uint64_t)p * st->rb, st->rb);
        st->copied++;
    } else { /* captured by a lookup: v = -(1 + row), and early's row is complete */
        copy_row(st->dst + (uint64_t)st->j * st->rb, st->ear + (uint64_t)(-v - 1) * st->rb,
                 st->rb);
    }
    __atomic_store_n(e, 0, __ATOMIC_RELEASE);
    st->po[st->j] = p;
    st->ao[st->j] = (v < 0 ? -v : v) - 1;
    st->ko[st->j] = st->kin != NULL ? st->kin[p] : (int64_t)p + (int64_t)st->offset;
    st->j++;
}

int walk_run(Walk *st, int (*yield)(void)) {
    Py_ssize_t at_p[WALK_BATCH];
    Py_ssize_t w = st->w, nw = st->nw, nb = st->nb;
    const int32_t *o = st->o;
    const uint8_t *bt = st->bt, *wd = st->wd;
    /* a batch of whole words' positions at a time: checked (nothing of the batch written
     * before), then their rows copied, each row prefetched AHEAD rows before its copy */
    while (w < nw && st->walked < st->max_pos) {
        Py_ssize_t m = 0, w_end = w;
        while (w_end < nw && st->walked + m < st->max_pos) {
            if (!wd[w_end >> 3]) { /* 8 words (512 positions) with nothing set */
                w_end = (w_end | 7) + 1;
                continue;
            }
            if (!(wd[w_end >> 3] & (1u << (w_end & 7)))) {
                w_end++;
                continue;
            }
            Py_ssize_t b = w_end * 8, len = nb - b < 8 ? nb - b : 8;
            uint64_t bitword = 0;
            memcpy(&bitword, bt + b, (size_t)len); /* little-endian bit order */
            if (m + __builtin_popcountll(bitword) > WALK_BATCH)
                break;
            for (uint64_t v = bitword; v; v &= v - 1, m++) {
                Py_ssize_t p = b * 8 + __builtin_ctzll(v);
                /* a lookup may negate the entry meanwhile: its magnitude stays */
                int64_t e = __atomic_load_n(o + p, __ATOMIC_ACQUIRE), r = (e < 0 ? -e : e) - 1;
                if (r < 0 || r >= st->early_rows || st->j + m >= st->n || p >= st->src_rows ||
                    (st->kin && p >= st->n_keys)) {
                    snprintf(st->err, sizeof st->err, "owed: position %zd names row %lld of "
                             "a %zd-row early, entry %zd of %zd (src %zd rows, keys %zd)", p,
                             (long long)r, st->early_rows, st->j + m, st->n, st->src_rows,
                             st->n_keys);
                    st->w = w;
                    return -1;
                }
                at_p[m] = p;
            }
            w_end++;
        }
        for (Py_ssize_t i = 0; i < m && i < AHEAD; i++) {
            PREFETCH(st->from + (uint64_t)at_p[i] * st->rb);
            PREFETCH(st->from + (uint64_t)at_p[i] * st->rb + st->rb - 1);
        }
        for (Py_ssize_t i = 0; i < m; i++) { /* out, in walk order */
            if (i + AHEAD < m) {
                PREFETCH(st->from + (uint64_t)at_p[i + AHEAD] * st->rb);
                PREFETCH(st->from + (uint64_t)at_p[i + AHEAD] * st->rb + st->rb - 1);
            }
            walk_copy(st, at_p[i]);
        }
        st->walked += m;
        if (w_end > w) /* the words collected: their bits (the last may be partial) */
            memset(st->bt + w * 8, 0, (size_t)((w_end * 8 < nb ? w_end * 8 : nb) - w * 8));
        w = w_end;
        if (yield != NULL && w < nw && yield()) {
            st->w = w;
            return 1;
        }
    }
    st->w = w < nw ? w : nw;
    return 0;
}

PyObject *walk_owed(PyObject *self, PyObject *args) {
    Bufs bs = {.n = 0};
    Walk st;
    PyObject *ret = NULL;
    if (walk_setup(args, &bs, &st) == 0) {
        if (walk_run(&st, NULL) < 0)
            PyErr_SetString(PyExc_ValueError, st.err);
        else
            ret = Py_BuildValue("nnn", st.w, st.walked, st.copied);
    }
    release(&bs);
    return ret;
}
