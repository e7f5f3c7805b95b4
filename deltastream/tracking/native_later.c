/* deltastream.tracking.native: mark_fresh and walk_owed run on the lane thread
 * (../native_lane.h) without the GIL, while the caller goes on.
 *
 *   mark_fresh_later(same arguments as mark_fresh) -> Marking
 *       The arguments are checked now (a bad one raises here, nothing queued) and the
 *       marking is queued. The caller must call Marking.wait() -> used' before it touches
 *       any of the buffers, or a row of src changes. Marking.done: whether it ran (no
 *       wait). The Marking holds the buffers until then; its deallocation waits too.
 *   walk_owed_later(same arguments as walk_owed) -> Walking
 *       The arguments are checked now and the whole walk is queued (max_positions as
 *       given). Walking.wait() -> (next_word, walked, copied), or the ValueError walk_owed
 *       would raise. Until then the caller touches none of the buffers but owed, and owed
 *       only through capture_owed (an entry the walk claimed is waited for there). The
 *       walk gives way to other queued jobs between batches of 256 positions.
 *   hold_lane(on)
 *       With a true on, queued jobs wait until hold_lane(False) (tests).
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

static int marking_run(LaneJob *j) {
    Marking *mk = (Marking *)((char *)j - offsetof(Marking, job));
    mk->used = mark_run(&mk->m);
    return 0;
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

typedef struct {
    PyObject_HEAD
    LaneJob job;
    Bufs bs;
    Walk st;
    int rc;   /* walk_run's result once the job ran */
    int held; /* bs not released yet */
} Walking;

static int walking_run(LaneJob *j) {
    Walking *wk = (Walking *)((char *)j - offsetof(Walking, job));
    wk->rc = walk_run(&wk->st, lane_busy);
    return wk->rc == 1;
}

static void walking_finish(Walking *wk) {
    if (!wk->held)
        return;
    if (!lane_finished(&wk->job)) {
        Py_BEGIN_ALLOW_THREADS
        lane_wait(&wk->job);
        Py_END_ALLOW_THREADS
    }
    release(&wk->bs);
    wk->held = 0;
}

static PyObject *walking_wait(PyObject *self, PyObject *unused) {
    Walking *wk = (Walking *)self;
    walking_finish(wk);
    if (wk->rc < 0) {
        PyErr_SetString(PyExc_ValueError, wk->st.err);
        return NULL;
    }
    return Py_BuildValue("nnn", wk->st.w, wk->st.walked, wk->st.copied);
}

static PyObject *walking_done(PyObject *self, void *unused) {
    Walking *wk = (Walking *)self;
    return PyBool_FromLong(!wk->held || lane_finished(&wk->job));
}

static void walking_dealloc(PyObject *self) {
    walking_finish((Walking *)self); /* the lane must be done with the buffers */
    PyObject_Free(self);
}

static PyMethodDef walking_methods[] = {
    {"wait", walking_wait, METH_NOARGS,
     "wait() -> (next_word, walked, copied): wait until the walk ran"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef walking_getset[] = {
    {"done", walking_done, NULL, "whether the walk ran (no wait)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject WalkingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "deltastream.tracking.native.Walking",
    .tp_basicsize = sizeof(Walking),
    .tp_dealloc = walking_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A walk_owed queued on the lane thread (walk_owed_later).",
    .tp_methods = walking_methods,
    .tp_getset = walking_getset,
};

int later_ready(void) {
    return PyType_Ready(&MarkingType) < 0 ? -1 : PyType_Ready(&WalkingType);
}

PyObject *walk_owed_later(PyObject *self, PyObject *args) {
    Walking *wk = PyObject_New(Walking, &WalkingType);
    if (wk == NULL)
        return NULL;
    wk->bs.n = 0;
    wk->held = 1;
    wk->rc = 0;
    wk->job.done = 1; /* not queued yet: nothing to wait for */
    if (walk_setup(args, &wk->bs, &wk->st) < 0) {
        Py_DECREF(wk);
        return NULL;
    }
    wk->job.run = walking_run;
    if (lane_submit(&wk->job) < 0) { /* no thread: now */
        wk->rc = walk_run(&wk->st, NULL);
        wk->job.done = 1;
    }
    return (PyObject *)wk;
}

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
