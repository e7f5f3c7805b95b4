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
 *   lane_jobs() -> (by_lane, by_waiters)
 *       Jobs finished so far by the lane thread, and by callers that waited for a job the
 *       lane had not started (they run it themselves).
 */
#include "native_tracking.h"
#include "../native_lane.h"

#include <stddef.h>

/* What a queued job's Python object holds: the job and the buffers it reads (until
 * waited for). Marking and Walking begin with one. */
typedef struct {
    PyObject_HEAD
    LaneJob job;
    Bufs bs;
    int held; /* bs not released yet */
} Queued;

/* Wait for the job (without the GIL) and release its buffers; once. */
static void queued_finish(Queued *q) {
    if (!q->held)
        return;
    if (!lane_finished(&q->job)) {
        Py_BEGIN_ALLOW_THREADS
        lane_wait(&q->job);
        Py_END_ALLOW_THREADS
    }
    release(&q->bs);
    q->held = 0;
}

static PyObject *queued_done(PyObject *self, void *unused) {
    Queued *q = (Queued *)self;
    return PyBool_FromLong(!q->held || lane_finished(&q->job));
}

static void queued_dealloc(PyObject *self) {
    queued_finish((Queued *)self); /* the lane must be done with the buffers */
    PyObject_Free(self);
}

/* A new object of type t (a Queued first): not queued, nothing held yet. */
static Queued *queued_new(PyTypeObject *t) {
    Queued *q = (Queued *)PyObject_New(Queued, t);
    if (q == NULL)
        return NULL;
    q->bs.n = 0;
    q->held = 1;
    q->job.done = 1; /* not queued yet: nothing to wait for */
    return q;
}

static PyGetSetDef queued_getset[] = {
    {"done", queued_done, NULL, "whether the job ran (no wait)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

typedef struct {
    Queued q;
    Mark m;
    Py_ssize_t used; /* the result, once the job ran */
} Marking;

static int marking_run(LaneJob *j) {
    Marking *mk = (Marking *)((char *)j - offsetof(Marking, q.job));
    mk->used = mark_run(&mk->m);
    return 0;
}

static PyObject *marking_wait(PyObject *self, PyObject *unused) {
    Marking *mk = (Marking *)self;
    queued_finish(&mk->q);
    return PyLong_FromSsize_t(mk->used);
}

static PyMethodDef marking_methods[] = {
    {"wait", marking_wait, METH_NOARGS, "wait() -> used: wait until the marking ran"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject MarkingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "deltastream.tracking.native.Marking",
    .tp_basicsize = sizeof(Marking),
    .tp_dealloc = queued_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A mark_fresh queued on the lane thread (mark_fresh_later).",
    .tp_methods = marking_methods,
    .tp_getset = queued_getset,
};

typedef struct {
    Queued q;
    Walk st;
    int rc; /* walk_run's result once the job ran */
} Walking;

static int walking_run(LaneJob *j) {
    Walking *wk = (Walking *)((char *)j - offsetof(Walking, q.job));
    wk->rc = walk_run(&wk->st, lane_busy);
    return wk->rc == 1;
}

static PyObject *walking_wait(PyObject *self, PyObject *unused) {
    Walking *wk = (Walking *)self;
    queued_finish(&wk->q);
    if (wk->rc < 0) {
        PyErr_SetString(PyExc_ValueError, wk->st.err);
        return NULL;
    }
    return Py_BuildValue("nnn", wk->st.w, wk->st.walked, wk->st.copied);
}

static PyMethodDef walking_methods[] = {
    {"wait", walking_wait, METH_NOARGS,
     "wait() -> (next_word, walked, copied): wait until the walk ran"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WalkingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "deltastream.tracking.native.Walking",
    .tp_basicsize = sizeof(Walking),
    .tp_dealloc = queued_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A walk_owed queued on the lane thread (walk_owed_later).",
    .tp_methods = walking_methods,
    .tp_getset = queued_getset,
};

int later_ready(void) {
    return PyType_Ready(&MarkingType) < 0 ? -1 : PyType_Ready(&WalkingType);
}

PyObject *mark_fresh_later(PyObject *self, PyObject *args) {
    Marking *mk = (Marking *)queued_new(&MarkingType);
    if (mk == NULL)
        return NULL;
    mk->used = 0;
    if (mark_setup(args, &mk->q.bs, &mk->m) < 0) {
        Py_DECREF(mk); /* not queued: the deallocation only releases the buffers */
        return NULL;
    }
    mk->q.job.run = marking_run;
    if (mk->m.n == 0 || lane_submit(&mk->q.job) < 0) { /* nothing to do, or no thread: now */
        mk->used = mark_run(&mk->m);
        mk->q.job.done = 1;
    }
    return (PyObject *)mk;
}

PyObject *walk_owed_later(PyObject *self, PyObject *args) {
    Walking *wk = (Walking *)queued_new(&WalkingType);
    if (wk == NULL)
        return NULL;
    wk->rc = 0;
    if (walk_setup(args, &wk->q.bs, &wk->st) < 0) {
        Py_DECREF(wk);
        return NULL;
    }
    wk->q.job.run = walking_run;
    if (lane_submit(&wk->q.job) < 0) { /* no thread: now */
        wk->rc = walk_run(&wk->st, NULL);
        wk->q.job.done = 1;
    }
    return (PyObject *)wk;
}

PyObject *hold_lane(PyObject *self, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    lane_hold(on);
    Py_RETURN_NONE;
}

PyObject *lane_jobs_done(PyObject *self, PyObject *unused) {
    long n[2];
    lane_jobs(n);
    return Py_BuildValue("ll", n[0], n[1]);
}
