/* What native.c, native_owed.c, native_later.c and native_sorted.c share: the checks of
 * bits and words, and mark_fresh, shared by native.c (checked and run at once) and
 * native_later.c (run on the lane thread of ../native_lane.h): mark_setup takes the
 * arguments into a Mark (with the GIL: errors are Python exceptions, buffers held in a
 * Bufs) and mark_run runs it (no Python object: runs without the GIL). */
#ifndef DELTASTREAM_NATIVE_TRACKING_H
#define DELTASTREAM_NATIVE_TRACKING_H

#include "../native_buffers.h"

/* mark_fresh's arguments, checked. */
typedef struct {
    const void *ids;
    int wide, by_occurrence;
    Py_ssize_t n, used, rb;
    uint8_t *bt, *wd, *a; /* bits, words (or NULL), arena (or NULL) */
    int32_t *s;
    int64_t *o;
    const uint8_t *w; /* src (or NULL) */
} Mark;

/* bits: uint8 [ceil(capacity / 8)], bit p & 7 of byte p >> 3 set iff slot[p] != 0. */
static inline int check_bits(const Py_buffer *bits, Py_ssize_t capacity) {
    if (bits->itemsize != 1 || bits->len != (capacity + 7) / 8) {
        PyErr_Format(PyExc_ValueError, "bits: %zd bytes for %zd positions (want %zd)",
                     bits->len, capacity, (capacity + 7) / 8);
        return -1;
    }
    return 0;
}

/* words: a bit per 64-bit word of bits (nb bytes), or NULL when not given. */
static inline int check_words(const Py_buffer *words, Py_ssize_t nb) {
    Py_ssize_t want = ((nb + 7) / 8 + 7) / 8;
    if (words != NULL && (words->itemsize != 1 || words->len != want)) {
        PyErr_Format(PyExc_ValueError, "words: %zd bytes for %zd bytes of bits (want %zd)",
                     words->len, nb, want);
        return -1;
    }
    return 0;
}

int mark_setup(PyObject *args, Bufs *bs, Mark *m);        /* -1 with an exception set */
Py_ssize_t mark_run(const Mark *m);                        /* the new used */

/* An owed entry the lane thread's walk is copying from the storage (native_owed.c): a
 * lookup's capture waits until the walk has stored 0 there. Never a row's own negation:
 * those are -(1 + row) >= -(2**31 - 1). */
#define CLAIMED INT32_MIN

/* walk_owed's arguments, checked, and its progress (walk_run goes on from it). */
typedef struct {
    int32_t *o;
    uint8_t *bt, *wd, *dst;
    const uint8_t *from, *ear;
    const int64_t *kin;
    int64_t *ko, *po, *ao;
    Py_ssize_t n, nb, nw, src_rows, n_keys, rb, early_rows;
    Py_ssize_t w, j, max_pos;   /* the next word, the next entry, the positions to walk */
    Py_ssize_t walked, copied;  /* so far */
    long long offset;
    char err[240];              /* walk_run's error (it runs without the GIL) */
} Walk;

/* native_owed.c */
PyObject *capture_owed(PyObject *self, PyObject *args);
PyObject *walk_owed(PyObject *self, PyObject *args);
int walk_setup(PyObject *args, Bufs *bs, Walk *st); /* -1 with an exception set */
/* Walk on from st (no Python object: runs without the GIL): 0 when max_pos positions were
 * walked or none is left, -1 on an entry naming no row (st->err), 1 when yield() said to
 * stop between two batches (call again to go on). */
int walk_run(Walk *st, int (*yield)(void));

/* native_later.c */
PyObject *mark_fresh_later(PyObject *self, PyObject *args);
PyObject *walk_owed_later(PyObject *self, PyObject *args);
PyObject *hold_lane(PyObject *self, PyObject *arg);
PyObject *lane_jobs_done(PyObject *self, PyObject *unused);
int later_ready(void); /* the Marking and Walking types made ready: 0, or -1 with an exception set */

/* native_sorted.c */
PyObject *merge_sorted(PyObject *self, PyObject *args);

#endif
