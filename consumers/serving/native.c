/* consumers.serving.native: the lookup path of a serving table in C.
 *
 * One call probes the id index for every id and gathers the rows of the slots found into a
 * float32 output (f32 or f16 storage), with software prefetching: the home bucket of an id
 * is prefetched PROBE_AHEAD ids before it is probed, a row ROW_AHEAD rows before it is
 * copied. A lookup of random ids is a chain of cache and TLB misses; numpy takes them one
 * after another, prefetching overlaps them (distances tuned on a 2-core AMD EPYC VM; the
 * results were flat within noise around these values).
 *
 * Same layout and protocol as consumers/serving/id_index.py and consumers/serving/core.py (read
 * those first): buckets are int64 [B, 2] (B a power of 2): the key, then two int32 value
 * copies (a row slot >= 1, 0 EMPTY_SLOT, -1 DELETED_SLOT). Home bucket: the top log2(B) bits of
 * (key ^ key >> 32) * 0x9E3779B97F4A7C15; linear probing; the first bucket holding the key
 * live in the copy read, or EMPTY_SLOT, decides. Readers never lock: the caller read state s
 * from hdr[H_SEQ] before choosing the index and rows; the read is valid iff
 * hdr[H_PREP] <= s + 1 after every row was copied (else the writer began to rebuild copy
 * s & 1 or to reuse a slot of state s: retry). Whatever a racing writer leaves in memory,
 * a probe stops after B buckets and a slot outside the rows is never dereferenced.
 *
 * Python API (buffers: anything exporting a C-contiguous buffer, e.g. numpy arrays):
 *   read_rows(hdr, tab, rows, s, keys, out, nogil) -> 1 valid, 0 overtaken (retry),
 *       2 valid but the index named a slot outside rows (a corrupt table)
 *   lookup_slots(tab, keys, col, out, nogil) -> None (out: int32 [n], slot or 0)
 * The writer's side (the caller holds the table's write lock; consumers/serving/id_index.py):
 *   index_find(tab, keys, col, pos, slot, nogil) -> None (pos: int64 [n], the bucket holding
 *       the key live in copy col or -1; slot: int32 [n], its slot or 0)
 *   index_insert(tab, keys, slots, col, other, pos, nogil) -> buckets newly used (they were
 *       EMPTY_SLOT); col -1: both copies; other -1: none. ValueError when no bucket is free.
 * nogil: release the GIL around the loop (worth it for big requests only: taking the GIL
 * back can wait for another thread's switch interval).
 * A reader's page warmer (native_warm.c; POSIX only), without the GIL:
 *   warm_follow(buf, path, next, hdr, word, gen, done, page, align, step, timeout_s,
 *       busy_s, idle_s) -> (done, why): reads one byte per page of buf [done, allocated
 *       bytes of the file at path, rounded down to align) as it grows, until
 *       hdr[word] != gen ("gen"), the file at next (None: no such file) is complete
 *       ("next"), the file is gone ("gone") or timeout_s passed ("timeout"); OSError when
 *       path cannot be stat'ed otherwise.
 */
#include "native_loops.h"

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

/* A buffer argument: its position in args, whether it is written, its name in errors. */
typedef struct {
    int arg;
    int writable;
    const char *name;
} BufArg;

static void release_bufs(Py_buffer *v, int n) {
    while (n-- > 0)
        PyBuffer_Release(&v[n]);
}

/* The n buffers of spec from args into v; -1 (an exception set, nothing held) on failure. */
static int get_bufs(PyObject *const *args, const BufArg *spec, int n, Py_buffer *v) {
    for (int i = 0; i < n; i++) {
        if (get_buf(args[spec[i].arg], &v[i], spec[i].writable, spec[i].name) < 0) {
            release_bufs(v, i);
            return -1;
        }
    }
    return 0;
}

/* Run stmt, without the GIL when nogil. */
#define MAYBE_NOGIL(nogil, stmt)        \
    do {                                \
        if (nogil) {                    \
            Py_BEGIN_ALLOW_THREADS      \
            stmt;                       \
            Py_END_ALLOW_THREADS        \
        } else {                        \
            stmt;                       \
        }                               \
    } while (0)

/* nargs == want, else a TypeError naming the signature. */
static int nargs_ok(Py_ssize_t nargs, Py_ssize_t want, const char *signature) {
    if (nargs == want)
        return 1;
    PyErr_Format(PyExc_TypeError, "%s: %zd arguments", signature, want);
    return 0;
}

static PyObject *read_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (!nargs_ok(nargs, 7, "read_rows(hdr, tab, rows, s, keys, out, nogil)"))
        return NULL;
    long long s = PyLong_AsLongLong(args[3]);
    if (s == -1 && PyErr_Occurred())
        return NULL;
    int nogil = PyObject_IsTrue(args[6]);
    if (nogil < 0)
        return NULL;
    static const BufArg spec[] = {{0, 0, "hdr"}, {1, 0, "tab"}, {2, 0, "rows"}, {4, 0, "keys"},
                                  {5, 1, "out"}};
    Py_buffer b[5];
    if (get_bufs(args, spec, 5, b) < 0)
        return NULL;
    Py_buffer *hdr = &b[0], *rows = &b[2], *keys = &b[3], *out = &b[4];
    PyObject *ret = NULL;
    Index ix;
    Rows r;
    if (!is_int64(hdr) || hdr->len < (H_PREP + 1) * 8) {
        PyErr_SetString(PyExc_ValueError, "hdr: expected the int64 header words of a table");
        goto done;
    }
    if (index_of(&b[1], &ix) < 0 || keys_of(keys) < 0)
        goto done;
    char rc = code_of(rows);
    if (rows->ndim != 2 ||
            !((rc == 'f' && rows->itemsize == 4) || (rc == 'e' && rows->itemsize == 2))) {
        PyErr_Format(PyExc_ValueError, "rows: expected a 2-D float32 or float16 array, got "
                     "format %s with %d dimensions", rows->format ? rows->format : "B",
                     rows->ndim);
        goto done;
    }
    Py_ssize_t n = keys->len / 8;
    r.base = (const char *)rows->buf;
    r.nrows = rows->shape[0];
    r.dim = rows->shape[1];
    r.row_bytes = r.dim * rows->itemsize;
    r.half = rc == 'e';
    if (code_of(out) != 'f' || out->itemsize != 4 || out->len != n * r.dim * 4) {
        PyErr_Format(PyExc_ValueError, "out: expected float32 [%zd, %zd], got %zd bytes of "
                     "format %s", n, r.dim, out->len, out->format ? out->format : "B");
        goto done;
    }
    const volatile int64_t *h = (const int64_t *)hdr->buf;
    int bad;
    MAYBE_NOGIL(nogil, bad = ds_gather(&ix, (int)(s & 1), &r, (const int64_t *)keys->buf,
                                       n, (float *)out->buf));
    ACQUIRE_FENCE();  /* every row was read before H_PREP is */
    ret = PyLong_FromLong(h[H_PREP] > s + 1 ? 0 : (bad ? 2 : 1));
done:
    release_bufs(b, 5);
    return ret;
}

static PyObject *lookup_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (!nargs_ok(nargs, 5, "lookup_slots(tab, keys, col, out, nogil)"))
        return NULL;
    int col = col_arg(args[2], "col", 0);
    if (col < -1)
        return NULL;
    int nogil = PyObject_IsTrue(args[4]);
    if (nogil < 0)
        return NULL;
    static const BufArg spec[] = {{0, 0, "tab"}, {1, 0, "keys"}, {3, 1, "out"}};
    Py_buffer b[3];
    if (get_bufs(args, spec, 3, b) < 0)
        return NULL;
    PyObject *ret = NULL;
    Index ix;
    Py_ssize_t n = b[1].len / 8;
    if (index_of(&b[0], &ix) == 0 && keys_of(&b[1]) == 0 && int_out(&b[2], n, 4, "out") == 0) {
        MAYBE_NOGIL(nogil, ds_slots_of(&ix, col, (const int64_t *)b[1].buf, n,
                                       (int32_t *)b[2].buf));
        Py_INCREF(Py_None);
        ret = Py_None;
    }
    release_bufs(b, 3);
    return ret;
}

static PyObject *index_find(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (!nargs_ok(nargs, 6, "index_find(tab, keys, col, pos, slot, nogil)"))
        return NULL;
    int col = col_arg(args[2], "col", 0);
    if (col < -1)
        return NULL;
    int nogil = PyObject_IsTrue(args[5]);
    if (nogil < 0)
        return NULL;
    static const BufArg spec[] = {{0, 0, "tab"}, {1, 0, "keys"}, {3, 1, "pos"}, {4, 1, "slot"}};
    Py_buffer b[4];
    if (get_bufs(args, spec, 4, b) < 0)
        return NULL;
    PyObject *ret = NULL;
    Index ix;
    Py_ssize_t n = b[1].len / 8;
    if (index_of(&b[0], &ix) == 0 && keys_of(&b[1]) == 0 && int_out(&b[2], n, 8, "pos") == 0
            && int_out(&b[3], n, 4, "slot") == 0) {
        MAYBE_NOGIL(nogil, ds_find_all(&ix, col, (const int64_t *)b[1].buf, n,
                                       (int64_t *)b[2].buf, (int32_t *)b[3].buf));
        Py_INCREF(Py_None);
        ret = Py_None;
    }
    release_bufs(b, 4);
    return ret;
}

static PyObject *index_insert(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (!nargs_ok(nargs, 7, "index_insert(tab, keys, slots, col, other, pos, nogil)"))
        return NULL;
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
    static const BufArg spec[] = {{0, 1, "tab"}, {1, 0, "keys"}, {2, 0, "slots"}, {5, 1, "pos"}};
    Py_buffer b[4];
    if (get_bufs(args, spec, 4, b) < 0)
        return NULL;
    Py_buffer *slots = &b[2];
    PyObject *ret = NULL;
    Index ix;
    Py_ssize_t n = b[1].len / 8, used;
    if (index_of(&b[0], &ix) < 0 || keys_of(&b[1]) < 0)
        goto done;
    if (code_of(slots) != 'i' || slots->itemsize != 4 || slots->len != n * 4) {
        PyErr_Format(PyExc_ValueError, "slots: expected int32 [%zd], got %zd bytes of format %s",
                     n, slots->len, slots->format ? slots->format : "B");
        goto done;
    }
    if (int_out(&b[3], n, 8, "pos") < 0)
        goto done;
    MAYBE_NOGIL(nogil, used = ds_insert_all((int64_t *)b[0].buf, ix.mask, ix.shift,
                                            (const int64_t *)b[1].buf,
                                            (const int32_t *)slots->buf, n, col, other,
                                            (int64_t *)b[3].buf));
    if (used < 0)
        PyErr_Format(PyExc_ValueError, "tab: no free bucket for key %zd of %zd (all %llu "
                     "buckets are live)", -1 - used, n, (unsigned long long)ix.mask + 1);
    else
        ret = PyLong_FromSsize_t(used);
done:
    release_bufs(b, 4);
    return ret;
}

#ifdef HAVE_MMAN
/* A float argument >= 0 in nanoseconds; -1 with an exception set. */
static int64_t seconds_arg(PyObject *obj, const char *what) {
    double v = PyFloat_AsDouble(obj);
    if (v == -1.0 && PyErr_Occurred())
        return -1;
    if (!(v >= 0.0 && v <= 86400.0)) {
        PyErr_Format(PyExc_ValueError, "%s: expected seconds in [0, 86400], got %R", what, obj);
        return -1;
    }
    return (int64_t)(v * 1e9);
}

static PyObject *warm_follow(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (!nargs_ok(nargs, 13, "warm_follow(buf, path, next, hdr, word, gen, done, page, "
                  "align, step, timeout_s, busy_s, idle_s)"))
        return NULL;
    static const BufArg spec[] = {{0, 0, "buf"}, {3, 0, "hdr"}};
    Py_buffer b[2];
    PyObject *path = NULL, *next = NULL, *ret = NULL;
    if (get_bufs(args, spec, 2, b) < 0)
        return NULL;
    if (!PyUnicode_FSConverter(args[1], &path) ||
            (args[2] != Py_None && !PyUnicode_FSConverter(args[2], &next)))
        goto done;
    WarmArgs a = {(const uint8_t *)b[0].buf, (int64_t)b[0].len, PyBytes_AS_STRING(path),
                  next ? PyBytes_AS_STRING(next) : NULL, NULL, 0, 0, 0, 0, 0, 0, 0};
    long long word = PyLong_AsLongLong(args[4]), done = PyLong_AsLongLong(args[6]);
    a.gen = PyLong_AsLongLong(args[5]);
    a.page = PyLong_AsLongLong(args[7]);
    a.align = PyLong_AsLongLong(args[8]);
    a.step = PyLong_AsLongLong(args[9]);
    if (PyErr_Occurred())
        goto done;
    if (!is_int64(&b[1]) || word < 0 || word >= b[1].len / 8) {
        PyErr_Format(PyExc_ValueError, "hdr, word: expected an int64 array and a word in it, "
                     "got word %lld of %zd bytes", word, b[1].len);
        goto done;
    }
    if (done < 0 || done > a.len || a.page < 1 || a.align < 1 || a.step < a.page) {
        PyErr_Format(PyExc_ValueError, "done, page, align, step: expected 0 <= done <= %lld, "
                     "page >= 1, align >= 1, step >= page, got %lld, %lld, %lld, %lld",
                     (long long)a.len, done, (long long)a.page, (long long)a.align,
                     (long long)a.step);
        goto done;
    }
    a.gen_word = (const int64_t *)b[1].buf + word;
    if ((a.timeout_ns = seconds_arg(args[10], "timeout_s")) < 0 ||
            (a.busy_ns = seconds_arg(args[11], "busy_s")) < 0 ||
            (a.idle_ns = seconds_arg(args[12], "idle_s")) < 0)
        goto done;
    int64_t at = done;
    int why, err = 0;
    Py_BEGIN_ALLOW_THREADS
    why = ds_warm_follow(&a, &at, &err);
    Py_END_ALLOW_THREADS
    if (why == WARM_ERROR) {
        errno = err;
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, args[1]);
        goto done;
    }
    static const char *names[] = {"timeout", "gen", "next", "gone"};
    ret = Py_BuildValue("(Ls)", (long long)at, names[why]);
done:
    Py_XDECREF(path);
    Py_XDECREF(next);
    release_bufs(b, 2);
    return ret;
}
#endif

static PyMethodDef methods[] = {
    {"read_rows", (PyCFunction)(void (*)(void))read_rows, METH_FASTCALL,
     "read_rows(hdr, tab, rows, s, keys, out, nogil) -> 1 valid, 0 retry, 2 corrupt"},
    {"lookup_slots", (PyCFunction)(void (*)(void))lookup_slots, METH_FASTCALL,
     "lookup_slots(tab, keys, col, out, nogil): int32 slots of keys (0: absent) into out"},
    {"index_find", (PyCFunction)(void (*)(void))index_find, METH_FASTCALL,
     "index_find(tab, keys, col, pos, slot, nogil): bucket (-1) and slot (0) of each key"},
    {"index_insert", (PyCFunction)(void (*)(void))index_insert, METH_FASTCALL,
     "index_insert(tab, keys, slots, col, other, pos, nogil) -> buckets newly used"},
#ifdef HAVE_MMAN
    {"warm_follow", (PyCFunction)(void (*)(void))warm_follow, METH_FASTCALL,
     "warm_follow(buf, path, next, hdr, word, gen, done, page, align, step, timeout_s, "
     "busy_s, idle_s) -> (done, why): read the pages of a growing file's mapping, without the GIL"},
#endif
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
    const char *f16 = ds_f16_init();
    if (PyModule_AddStringConstant(m, "F16", f16) < 0 ||
            PyModule_AddIntConstant(m, "H_PREP", H_PREP) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
