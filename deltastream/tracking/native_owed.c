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
 *       or without keys p + offset; owed[p] and the bits walked are cleared. out and early
 *       hold one row per entry. A bit whose entry names no row is a ValueError (the words
 *       before it stay walked).
 */
#include "native_tracking.h"
#include "../native_rows.h"

#include <stdint.h>
#include <string.h>

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
        int64_t r = (int64_t)o[ID_AT(i)] - 1;
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
        int64_t p = ID_AT(i), r = (int64_t)o[p] - 1;
        if (r < 0)
            continue;
        copy_row(dst + (uint64_t)r * rb, from + (uint64_t)(by_occurrence ? i : p) * rb, rb);
        o[p] = -o[p]; /* captured; walk_owed still finds its row */
        k++;
    }
#undef ID_AT
    ret = PyLong_FromSsize_t(k);
done:
    release(&bs);
    return ret;
}

#define WALK_BATCH 256 /* positions collected (and their rows prefetched) before copies */

PyObject *walk_owed(PyObject *self, PyObject *args) {
    PyObject *o_owed, *o_bits, *o_words, *o_src, *o_early, *o_out, *o_keys, *o_ids, *o_pos;
    PyObject *o_at;
    Py_ssize_t word, max_pos, rb, j;
    long long offset;
    if (!PyArg_ParseTuple(args, "OOOnnOOOnOOOOLn", &o_owed, &o_bits, &o_words, &word, &max_pos,
                          &o_src, &o_early, &o_out, &rb, &o_keys, &o_ids, &o_pos, &o_at,
                          &offset, &j))
        return NULL;
    Bufs bs = {.n = 0};
    PyObject *ret = NULL;
    Py_buffer *owed = take(&bs, o_owed, 1, "owed");
    Py_buffer *bits = owed == BAD ? NULL : take(&bs, o_bits, 1, "bits");
    Py_buffer *words = bits == BAD ? NULL : take(&bs, o_words, 1, "words");
    Py_buffer *src = words == BAD ? NULL : take(&bs, o_src, 0, "src");
    Py_buffer *early = src == BAD ? NULL : take(&bs, o_early, 0, "early");
    Py_buffer *out = early == BAD ? NULL : take(&bs, o_out, 1, "out");
    Py_buffer *keys = out == BAD ? NULL : take(&bs, o_keys, 0, "keys");
    Py_buffer *ids = keys == BAD ? NULL : take(&bs, o_ids, 1, "ids_out");
    Py_buffer *pos = ids == BAD ? NULL : take(&bs, o_pos, 1, "pos_out");
    Py_buffer *ats = pos == BAD ? NULL : take(&bs, o_at, 1, "at_out");
    if (owed == BAD || bits == BAD || words == BAD || src == BAD || early == BAD || out == BAD ||
        keys == BAD || ids == BAD || pos == BAD || ats == BAD)
        goto done;
    if (!owed || !bits || !words || !src || !early || !out || !ids || !pos || !ats) {
        PyErr_SetString(PyExc_TypeError, "every argument but keys is required");
        goto done;
    }
    if (check_item(owed, 4, "i", "owed") < 0 || check_bits(bits, owed->len / 4) < 0 ||
        check_words(words, bits->len) < 0 || check_item(pos, 8, "ql", "pos_out") < 0 ||
        check_item(ids, 8, "ql", "ids_out") < 0 || check_item(ats, 8, "ql", "at_out") < 0 ||
        (keys != NULL && check_item(keys, 8, "ql", "keys") < 0))
        goto done;
    Py_ssize_t n = pos->len / 8;
    if (ids->len != pos->len || ats->len != pos->len || j < 0 || j > n) {
        PyErr_Format(PyExc_ValueError, "ids_out, pos_out and at_out: %zd entries each (got "
                     "%zd, %zd, %zd), from entry %zd", n, ids->len / 8, pos->len / 8,
                     ats->len / 8, j);
        goto done;
    }
    if (rb <= 0 || src->len % rb || out->len != n * rb || early->len != n * rb) {
        PyErr_Format(PyExc_ValueError, "src (%zd bytes), early (%zd) and out (%zd) are not "
                     "rows of %zd bytes, early and out one per entry (%zd)", src->len,
                     early->len, out->len, rb, n);
        goto done;
    }
    int32_t *o = (int32_t *)owed->buf;
    uint8_t *bt = (uint8_t *)bits->buf, *wd = (uint8_t *)words->buf, *dst = (uint8_t *)out->buf;
    const uint8_t *from = (const uint8_t *)src->buf, *ear = (const uint8_t *)early->buf;
    const int64_t *kin = keys ? (const int64_t *)keys->buf : NULL;
    int64_t *ko = (int64_t *)ids->buf, *po = (int64_t *)pos->buf, *ao = (int64_t *)ats->buf;
    Py_ssize_t nb = bits->len, nw = (nb + 7) / 8, src_rows = src->len / rb;
    Py_ssize_t n_keys = keys ? keys->len / 8 : 0, walked = 0, copied = 0;
    Py_ssize_t w = word < 0 ? 0 : word;
    /* a batch of whole words' positions at a time: checked (nothing of the batch written
     * before), then their rows copied (the storage's for a row still owed, else the one a
     * lookup copied early), each prefetched AHEAD rows before its copy */
    Py_ssize_t at_p[WALK_BATCH], w_end = w;
    const uint8_t *row[WALK_BATCH];
    while (w < nw && walked < max_pos) {
        Py_ssize_t m = 0;
        w_end = w;
        while (w_end < nw && walked + m < max_pos) {
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
                int64_t e = o[p], r = (e < 0 ? -e : e) - 1;
                if (r < 0 || r >= n || j + m >= n || p >= src_rows || (kin && p >= n_keys)) {
                    PyErr_Format(PyExc_ValueError, "owed: position %zd names row %lld of a "
                                 "%zd-row out, entry %zd (src %zd rows, keys %zd)", p,
                                 (long long)r, n, j + m, src_rows, n_keys);
                    goto done;
                }
                at_p[m] = p;
                row[m] = e > 0 ? from + (uint64_t)p * rb : ear + (uint64_t)r * rb;
            }
            w_end++;
        }
        for (Py_ssize_t i = 0; i < m && i < AHEAD; i++) {
            PREFETCH(row[i]);
            PREFETCH(row[i] + rb - 1);
        }
        for (Py_ssize_t i = 0; i < m; i++, j++) { /* out, in walk order */
            if (i + AHEAD < m) {
                PREFETCH(row[i + AHEAD]);
                PREFETCH(row[i + AHEAD] + rb - 1);
            }
            Py_ssize_t p = at_p[i];
            int64_t e = o[p];
            copy_row(dst + (uint64_t)j * rb, row[i], rb);
            copied += e > 0;
            o[p] = 0;
            po[j] = p;
            ao[j] = (e < 0 ? -e : e) - 1;
            ko[j] = kin != NULL ? kin[p] : (int64_t)p + (int64_t)offset;
        }
        walked += m;
        if (w_end > w) /* the words collected: their bits (the last may be partial) */
            memset(bt + w * 8, 0, (size_t)((w_end * 8 < nb ? w_end * 8 : nb) - w * 8));
        w = w_end;
    }
    ret = Py_BuildValue("nnn", w < nw ? w : nw, walked, copied);
done:
    release(&bs);
    return ret;
}
