/* deltastream.publishing.native: the serving errors of a hand-off's rows in one pass.
 *
 * The torch twin, and what each output means, is row_errors in
 * deltastream/publishing/serving_error.py (read it first); a test runs both on the same rows
 * and compares. torch needs about ten passes over [n, dim] for the same result (a float64
 * copy of the current rows, the subtraction, two norms, the finiteness tests, the
 * where/masked_fill of the special cases, an abs and an amax for the range check), each
 * with its own temporaries, and holds the GIL between them; here each row is read once, in
 * float64, without the GIL (a budget's worker runs this beside the training thread).
 *
 * Python API (buffers: C-contiguous, e.g. numpy arrays):
 *   row_errors(current, served, zero, dim, err, norm, finite, amax) -> None
 *       current, served: float32 or float64 [n * dim] (the same type); zero: bool/uint8
 *       [n] or None (rows predictors hold as zeros: served ignored); err, norm: writable
 *       float64 [n]; finite: writable bool/uint8 [n]; amax: writable float64 [n] or None
 *       (each row's largest |value|). err = ||current - served||_2 and norm =
 *       ||current||_2, summed in float64 in column order; a row whose current value holds a
 *       NaN/Inf gets finite 0 and NaN err/norm/amax; a finite row whose err is not finite
 *       (a non-finite served value) gets err +inf.
 */
#include "../native_buffers.h"

#include <math.h>
#include <stdint.h>

typedef struct {
    Py_ssize_t n, dim;
    const uint8_t *zero;
    double *err, *norm, *amax;
    uint8_t *finite;
} Out;

/* One row type: T is float or double. A float32 square cannot overflow a float64 sum of
 * ~2**30 of them, so a float32 row is finite iff its norm is; float64 values are tested. */
#define ROW_ERRORS(NAME, T, TEST_EACH)                                                        \
    static void NAME(const T *cur, const T *srv, const Out *o) {                             \
        const Py_ssize_t dim = o->dim;                                                       \
        for (Py_ssize_t i = 0; i < o->n; i++, cur += dim, srv += dim) {                      \
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

static PyObject *row_errors(PyObject *self, PyObject *args) {
    PyObject *cur_o, *srv_o, *zero_o, *err_o, *norm_o, *fin_o, *amax_o;
    Py_ssize_t dim;
    if (!PyArg_ParseTuple(args, "OOOnOOOO", &cur_o, &srv_o, &zero_o, &dim, &err_o, &norm_o,
                          &fin_o, &amax_o))
        return NULL;
    Bufs bs = {.n = 0};
    PyObject *ret = NULL;
    Py_buffer *cur = take(&bs, cur_o, 0, "current"), *srv = BAD, *zero = BAD, *err = BAD,
              *norm = BAD, *fin = BAD, *amax = BAD;
    if (cur == BAD || (srv = take(&bs, srv_o, 0, "served")) == BAD ||
        (zero = take(&bs, zero_o, 0, "zero")) == BAD || (err = take(&bs, err_o, 1, "err")) == BAD ||
        (norm = take(&bs, norm_o, 1, "norm")) == BAD ||
        (fin = take(&bs, fin_o, 1, "finite")) == BAD || (amax = take(&bs, amax_o, 1, "amax")) == BAD)
        goto done;
    if (!cur || !srv || !err || !norm || !fin) {
        PyErr_SetString(PyExc_ValueError, "current, served, err, norm and finite are required");
        goto done;
    }
    if (dim < 1) {
        PyErr_Format(PyExc_ValueError, "dim must be >= 1, got %zd", dim);
        goto done;
    }
    const Py_ssize_t size = cur->itemsize, n = cur->len / (size ? size : 1) / dim;
    if (size != 4 && size != 8) {
        PyErr_Format(PyExc_ValueError, "current: float32 or float64 rows expected (format %s)",
                     cur->format ? cur->format : "B");
        goto done;
    }
    const char *fd = size == 4 ? "f" : "d";
    if (check_items(cur, n * dim, size, fd, "current") || check_items(srv, n * dim, size, fd, "served") ||
        (zero && check_items(zero, n, 1, "?bB", "zero")) || check_items(err, n, 8, "d", "err") ||
        check_items(norm, n, 8, "d", "norm") || check_items(fin, n, 1, "?bB", "finite") ||
        (amax && check_items(amax, n, 8, "d", "amax")))
        goto done;
    const Out o = {n, dim, zero ? (const uint8_t *)zero->buf : NULL, (double *)err->buf,
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

static PyMethodDef methods[] = {
    {"row_errors", row_errors, METH_VARARGS,
     "row_errors(current, served, zero, dim, err, norm, finite, amax) -> None: serving "
     "errors of rows in one pass"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "native",
                                    "Serving errors of a hand-off's rows in one pass.", -1,
                                    methods};

PyMODINIT_FUNC PyInit_native(void) { return PyModule_Create(&module); }
