/* deltastream.tracking.native: mark_fresh run on the lane thread (../native_lane.h) without
 * the GIL, while the caller goes on.
 *
 *   mark_fresh_later(same arguments as mark_fresh) -> Marking
 *       The arguments are checked now (a bad one raises here, nothing queued) and the
 *       marking is queued. The caller must call Marking.wait() -> used' before it touches
 *       any of the buffers, or a row of src changes. Marking.done: whether it ran (no
 *       wait). The Marking holds the buffers until then; its deallocation waits too.
 *   hold_lane(on)
 *       With a true on, queued markings wait until hold_lane(False) (tests).
 */
#include "native_tracking.h"
#include "../native_lane.h"

#include <stddef.h>

typedef struct {
    PyObject_HEAD
    LaneJob job;
    Bufs bs;
    Mark m;
    Py_ssize_t used; /* the result, once the job ran */
    int held;        /* bs not released yet */
} Marking;

static void marking_run(LaneJob *j) {
    Marking *mk = (Marking *)((char *)j - offsetof(Marking, job));
    mk->used = mark_run(&mk->m);
}

/* Wait for the job (without the GIL) and release its buffers; once. */
static void marking_finish(Marking *mk) {
    if (!mk->held)
        return;
    if (!lane_finished(&mk->job)) {
        Py_BEGIN_ALLOW_THREADS
        lane_wait(&mk->job);
        Py_END_ALLOW_THREADS
    }
    release(&mk->bs);
    mk->held = 0;
}

static PyObject *marking_wait(PyObject *self, PyObject *unused) {
    Marking *mk = (Marking *)self;
    marking_finish(mk);
    return PyLong_FromSsize_t(mk->used);
}

static PyObject *marking_done(PyObject *self, void *unused) {
    Marking *mk = (Marking *)self;
    return PyBool_FromLong(!mk->held || lane_finished(&mk->job));
}

static void marking_dealloc(PyObject *self) {
    marking_finish((Marking *)self); /* the lane must be done with the buffers */
    PyObject_Free(self);
}

static PyMethodDef marking_methods[] = {
    {"wait", marking_wait, METH_NOARGS, "wait() -> used: wait until the marking ran"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef marking_getset[] = {
    {"done", marking_done, NULL, "whether the marking ran (no wait)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject MarkingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "deltastream.tracking.native.Marking",
    .tp_basicsize = sizeof(Marking),
    .tp_dealloc = marking_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A mark_fresh queued on the lane thread (mark_fresh_later).",
    .tp_methods = marking_methods,
    .tp_getset = marking_getset,
};

int later_ready(void) { return PyType_Ready(&MarkingType); }

PyObject *mark_fresh_later(PyObject *self, PyObject *args) {
    Marking *mk = PyObject_New(Marking, &MarkingType);
    if (mk == NULL)
        return NULL;
    mk->bs.n = 0;
    mk->held = 1;
    mk->job.done = 1; /* not queued yet: nothing to wait for */
    mk->used = 0;
    if (mark_setup(args, &mk->bs, &mk->m) < 0) {
        Py_DECREF(mk); /* not queued: the deallocation only releases the buffers */
        return NULL;
    }
    mk->job.run = marking_run;
    if (mk->m.n == 0 || lane_submit(&mk->job) < 0) { /* nothing to do, or no thread: now */
        mk->used = mark_run(&mk->m);
        mk->job.done = 1;
    }
    return (PyObject *)mk;
}

PyObject *hold_lane(PyObject *self, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    lane_hold(on);
    Py_RETURN_NONE;
}
