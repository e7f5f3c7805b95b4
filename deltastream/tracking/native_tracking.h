/* mark_fresh, shared by native.c (checked and run at once) and native_later.c (run on the
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

int mark_setup(PyObject *args, Bufs *bs, Mark *m);        /* -1 with an exception set */
Py_ssize_t mark_run(const Mark *m);                        /* the new used */

/* native_later.c */
PyObject *mark_fresh_later(PyObject *self, PyObject *args);
PyObject *hold_lane(PyObject *self, PyObject *arg);
int later_ready(void); /* the Marking type made ready: 0, or -1 with an exception set */

#endif
