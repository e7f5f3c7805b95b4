/* deltastream.publishing.native: the budget worker's passes over a hand-off's rows.
 *
 * The torch twin of row_errors, and what each output means, is row_errors in
 * deltastream/publishing/serving_error.py (read it first); a test runs both on the same rows
 * and compares. torch needs about ten passes over [n, dim] for the same result (a float64
 * copy of the current rows, the subtraction, two norms, the finiteness tests, the
 * where/masked_fill of the special cases, an abs and an amax for the range check), each
 * with its own temporaries, and holds the GIL between them; here each row is read once, in
 * float64, without the GIL (a budget's worker runs this beside the training thread).
 * The rows may be read through index arrays (the rows a merge scores are scattered over
 * the hand-off and the pending slots): no gathered copies. move_rows is the merge's row
 * copy between such places (torch's index_copy_ takes ~3x longer per row on the CPU).
 *
 * Python API (buffers: C-contiguous, e.g. numpy arrays):
 *   row_errors(current, served, zero, dim, err, norm, finite, amax[, cur_at, srv_at]) -> None
 *       current, served: float32 or float64 rows of dim values (the same type); cur_at,
 *       srv_at: int64 [n] or None: row i is current row cur_at[i] (row i when None), and
 *       served row srv_at[i]; zero: bool/uint8 [n] or None (rows predictors hold as zeros:
 *       served ignored); err, norm: writable float64 [n]; finite: writable bool/uint8 [n];
 *       amax: writable float64 [n] or None (each row's largest |value|). err =
 *       ||current - served||_2 and norm = ||current||_2, summed in float64 in column order;
 *       a row whose current value holds a NaN/Inf gets finite 0 and NaN err/norm/amax; a
 *       finite row whose err is not finite (a non-finite served value) gets err +inf.
 *       n is the length of the index arrays, else of current; an index outside its rows
 *       is an IndexError (nothing written).
 *   move_rows(dst, dst_at, src, src_at, row_bytes) -> n
 *       dst row dst_at[i] = src row src_at[i] for i < n (either index None: row i); rows of
 *       row_bytes bytes; dst_at must not repeat (the last copy would win).
 *   pack(dst, pieces) -> bytes
 *       pieces: a sequence of (offset, address, nbytes): the nbytes at address (memory the
 *       caller keeps alive and unchanged until this returns, e.g. a contiguous CPU
 *       tensor's data_ptr()) go to dst[offset : offset + nbytes]. A piece outside dst is
 *       a ValueError naming it, raised before anything is written. The worker process's
 *       parent packs a hand-off with it: one call, the copies without the GIL (a torch
 *       copy per tensor takes the GIL back between them, from the training thread).
 */
#include "../native_buffers.h"
#include "../native_rows.h"

#include <math.h>
#include <stdint.h>

typedef struct {
    Py_ssize_t n, dim;
    const int64_t *cur_at, *srv_at; /* NULL: row i */
    const uint8_t *zero;
    double *err, *norm, *amax;
    uint8_t *finite;
} Out;

/* One row type: T is float or double. A float32 square cannot overflow a float64 sum of
 * ~2**30 of them, so a float32 row is finite iff its norm is; float64 values are tested. */
#define ROW_ERRORS(NAME, T, TEST_EACH)                                                        \
    static void NAME(const T *cur0, const T *srv0, const Out *o) {                           \
        const Py_ssize_t dim = o->dim;                                                       \
        for (Py_ssize_t i = 0; i < o->n; i++) {                                              \
            if (i + AHEAD < o->n) {                                                          \
                if (o->cur_at)                                                               \
                    PREFETCH(cur0 + o->cur_at[i + AHEAD] * dim);                             \
                if (o->srv_at)                                                               \
                    PREFETCH(srv0 + o->srv_at[i + AHEAD] * dim);                             \
            }                                                                                \
            const T *cur = cur0 + (o->cur_at ? o->cur_at[i] : i) * dim;                      \
            const T *srv = srv0 + (o->srv_at ? o->srv_at[i] : i) * dim;                      \
            double s2 = 0.0, n2 = 0.0, big = 0.0;                                            \
            int ok = 1;                                                                      \
            const int z = o->zero && o->zero[i];                                             \
            for (Py_ssize_t j = 0; j < dim; j++) {                                           \
                const double c = (double)cur[j];                                             \
                const double d = z ? c : c - (double)srv[j];                                 \
                s2 += d * d;                                                                 \
                n2 += c * c;                                                                 \
                big = fabs(c) > big ? fabs(c) : big;                                         \
                if (TEST_EACH)                                                               \
                    ok &= isfinite(c) != 0;                                                  \
            }                                                                                \
            if (!TEST_EACH)                                                                  \
                ok = isfinite(n2) != 0;                                                      \
            double e = sqrt(s2);                                                             \
            if (!ok)                                                                         \
                e = n2 = big = NAN;                                                          \
            else if (!isfinite(e))                                                           \
                e = INFINITY;                                                                \
            o->err[i] = e;                                                                   \
            o->norm[i] = ok ? sqrt(n2) : NAN;                                                \
            o->finite[i] = (uint8_t)ok;                                                      \
            if (o->amax)                                                                     \
                o->amax[i] = big;                                                            \
        }                                                                                    \
    }

ROW_ERRORS(errors_f32, float, 0)
ROW_ERRORS(errors_f64, double, 1)

/* The rows an index array or, without one, the rows themselves count. */
static Py_ssize_t count_rows(const Py_buffer *at, Py_ssize_t rows) {
    return at ? at->len / 8 : rows;
}

static PyObject *row_errors(PyObject *self, PyObject *args) {
    PyObject *cur_o, *srv_o, *zero_o, *err_o, *norm_o, *fin_o, *amax_o, *cat_o = Py_None,
             *sat_o = Py_None;
    Py_ssize_t dim;
    if (!PyArg_ParseTuple(args, "OOOnOOOO|OO", &cur_o, &srv_o, &zero_o, &dim, &err_o, &norm_o,
                          &fin_o, &amax_o, &cat_o, &sat_o))
        return NULL;
    Bufs bs = {.n = 0};
    PyObject *ret = NULL;
    Py_buffer *cur = take(&bs, cur_o, 0, "current"), *srv = BAD, *zero = BAD, *err = BAD,
              *norm = BAD, *fin = BAD, *amax = BAD, *cat = BAD, *sat = BAD;
    if (cur == BAD || (srv = take(&bs, srv_o, 0, "served")) == BAD ||
        (zero = take(&bs, zero_o, 0, "zero")) == BAD || (err = take(&bs, err_o, 1, "err")) == BAD ||
        (norm = take(&bs, norm_o, 1, "norm")) == BAD ||
        (fin = take(&bs, fin_o, 1, "finite")) == BAD || (amax = take(&bs, amax_o, 1, "amax")) == BAD ||
        (cat = take(&bs, cat_o, 0, "cur_at")) == BAD || (sat = take(&bs, sat_o, 0, "srv_at")) == BAD)
        goto done;
    if (!cur || !srv || !err || !norm || !fin) {
        PyErr_SetString(PyExc_ValueError, "current, served, err, norm and finite are required");
        goto done;
    }
    if (dim < 1) {
        PyErr_Format(PyExc_ValueError, "dim must be >= 1, got %zd", dim);
        goto done;
    }
    const Py_ssize_t size = cur->itemsize;
    if (size != 4 && size != 8) {
        PyErr_Format(PyExc_ValueError, "current: float32 or float64 rows expected (format %s)",
                     cur->format ? cur->format : "B");
        goto done;
    }
    const char *fd = size == 4 ? "f" : "d";
    const Py_ssize_t crows = cur->len / size / dim, srows = srv->len / size / dim;
    if (check_item(cur, size, fd, "current") || check_item(srv, size, fd, "served") ||
        cur->len != crows * size * dim || srv->len != srows * size * dim ||
        check_at(cat, crows, "cur_at") || check_at(sat, srows, "srv_at")) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "current/served: not whole rows of %zd values", dim);
        goto done;
    }
    const Py_ssize_t n = count_rows(cat, crows);
    if (count_rows(sat, srows) != n) {
        PyErr_Format(PyExc_ValueError, "served: %zd rows for %zd current rows",
                     count_rows(sat, srows), n);
        goto done;
    }
    if ((zero && check_items(zero, n, 1, "?bB", "zero")) || check_items(err, n, 8, "d", "err") ||
        check_items(norm, n, 8, "d", "norm") || check_items(fin, n, 1, "?bB", "finite") ||
        (amax && check_items(amax, n, 8, "d", "amax")))
        goto done;
    const Out o = {n, dim, cat ? (const int64_t *)cat->buf : NULL,
                   sat ? (const int64_t *)sat->buf : NULL,
                   zero ? (const uint8_t *)zero->buf : NULL, (double *)err->buf,
                   (double *)norm->buf, amax ? (double *)amax->buf : NULL, (uint8_t *)fin->buf};
    Py_BEGIN_ALLOW_THREADS
    if (size == 4)
        errors_f32((const float *)cur->buf, (const float *)srv->buf, &o);
    else
        errors_f64((const double *)cur->buf, (const double *)srv->buf, &o);
    Py_END_ALLOW_THREADS
    ret = Py_NewRef(Py_None);
done:
    release(&bs);
    return ret;
}

static PyObject *move_rows(PyObject *self, PyObject *args) {
    PyObject *dst_o, *dat_o, *src_o, *sat_o;
    Py_ssize_t rb;
    if (!PyArg_ParseTuple(args, "OOOOn", &dst_o, &dat_o, &src_o, &sat_o, &rb))
        return NULL;
    Bufs bs = {.n = 0};
    PyObject *ret = NULL;
    Py_buffer *dst = take(&bs, dst_o, 1, "dst"), *dat = BAD, *src = BAD, *sat = BAD;
    if (dst == BAD || (dat = take(&bs, dat_o, 0, "dst_at")) == BAD ||
        (src = take(&bs, src_o, 0, "src")) == BAD || (sat = take(&bs, sat_o, 0, "src_at")) == BAD)
        goto done;
    if (!dst || !src || (!dat && !sat)) {
        PyErr_SetString(PyExc_ValueError, "dst, src and at least one index are required");
        goto done;
    }
    if (rb <= 0 || dst->len % rb || src->len % rb) {
        PyErr_Format(PyExc_ValueError, "dst (%zd bytes) and src (%zd bytes) are not rows of %zd "
                     "bytes", dst->len, src->len, rb);
        goto done;
    }
    const Py_ssize_t drows = dst->len / rb, srows = src->len / rb;
    if (check_at(dat, drows, "dst_at") || check_at(sat, srows, "src_at"))
        goto done;
    const Py_ssize_t n = count_rows(dat, drows);
    if (count_rows(sat, srows) != n) {
        PyErr_Format(PyExc_ValueError, "src: %zd rows for %zd dst rows", count_rows(sat, srows), n);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    copy_rows_at((uint8_t *)dst->buf, dat ? (const int64_t *)dat->buf : NULL,
                 (const uint8_t *)src->buf, sat ? (const int64_t *)sat->buf : NULL, n, rb);
    Py_END_ALLOW_THREADS
    ret = PyLong_FromSsize_t(n);
done:
    release(&bs);
    return ret;
}

static PyObject *pack(PyObject *self, PyObject *args) {
    PyObject *dst_o, *pieces_o;
    if (!PyArg_ParseTuple(args, "OO", &dst_o, &pieces_o))
        return NULL;
    Bufs bs = {.n = 0};
    PyObject *seq = NULL, *ret = NULL;
    Py_ssize_t *at = NULL;
    Py_buffer *dst = take(&bs, dst_o, 1, "dst");
    if (dst == BAD)
        goto done;
    if (!dst) {
        PyErr_SetString(PyExc_TypeError, "pack: dst is required");
        goto done;
    }
    seq = PySequence_Fast(pieces_o, "pack: pieces must be a sequence");
    if (!seq)
        goto done;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    at = PyMem_Malloc(sizeof(Py_ssize_t) * 3 * (size_t)(n > 0 ? n : 1));
    if (!at) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t off, nb;
        unsigned long long addr;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "nKn", &off, &addr, &nb))
            goto done;
        if (off < 0 || nb < 0 || off > dst->len - nb || (nb > 0 && addr == 0)) {
            PyErr_Format(PyExc_ValueError, "pack: piece %zd (offset %zd, %zd bytes) is outside "
                         "the %zd-byte buffer", i, off, nb, dst->len);
            goto done;
        }
        at[3 * i] = off;
        at[3 * i + 1] = (Py_ssize_t)addr;
        at[3 * i + 2] = nb;
        total += nb;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        if (at[3 * i + 2])
            memcpy((uint8_t *)dst->buf + at[3 * i], (const void *)at[3 * i + 1], (size_t)at[3 * i + 2]);
    Py_END_ALLOW_THREADS
    ret = PyLong_FromSsize_t(total);
done:
    PyMem_Free(at);
    Py_XDECREF(seq);
    release(&bs);
    return ret;
}

static PyMethodDef methods[] = {
    {"row_errors", row_errors, METH_VARARGS,
     "row_errors(current, served, zero, dim, err, norm, finite, amax, cur_at, srv_at) -> None: "
     "serving errors of rows in one pass"},
    {"move_rows", move_rows, METH_VARARGS,
     "move_rows(dst, dst_at, src, src_at, row_bytes) -> n: dst row dst_at[i] = src row "
     "src_at[i]"},
    {"pack", pack, METH_VARARGS,
     "pack(dst, pieces) -> bytes: each (offset, address, nbytes) piece copied into dst"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "native",
                                    "The budget worker's passes over a hand-off's rows.", -1,
                                    methods};

PyMODINIT_FUNC PyInit_native(void) { return PyModule_Create(&module); }
