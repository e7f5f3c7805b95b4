/* What native.c, native_owed.c and native_later.c share: the checks of bits and words, and
 * mark_fresh, shared by native.c (checked and run at once) and native_later.c (run on the
 * lane thread of ../native_lane.h): mark_setup takes the arguments into a Mark (with the
 * GIL: errors are Python exceptions, buffers held in a Bufs) and mark_run runs it (no
 * Python object: runs without the GIL). */
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

/* native_owed.c */
PyObject *capture_owed(PyObject *self, PyObject *args);
PyObject *walk_owed(PyObject *self, PyObject *args);

/* native_later.c */
PyObject *mark_fresh_later(PyObject *self, PyObject *args);
PyObject *hold_lane(PyObject *self, PyObject *arg);
int later_ready(void); /* the Marking type made ready: 0, or -1 with an exception set */

#endif
