/* deltastream.tracking.native: the union of two ascending id sets in one linear pass
 * (sorted_ids.py's union; its torch twin takes three binary searches, a nonzero and two
 * scatters: 2.8 ms against 0.38 for 25K + 25K ids on the CI machine. A round worker unites
 * its carried rows with each round's fresh ones).
 *
 *   merge_sorted(a, b, out, pos_a, b_only, pos_b, in_a, at_a) -> m
 *       a: int64 [na], b: int64 [nb], each strictly ascending (checked: a ValueError
 *       naming the first index out of order, nothing written); writable int64 out
 *       [na + nb], pos_a [na], b_only [nb], pos_b [nb], at_a [nb] and bool in_a [nb].
 *       m: the ids of b not in a. out[:na + m] is the union, ascending; pos_a[i] the
 *       position of a[i] in it; b_only[:m] the indices in b of the ids not in a and
 *       pos_b[:m] their positions; in_a[j] whether b[j] is in a and at_a[j] the index in
 *       a of the first id >= b[j], clamped to na - 1 (searchsorted's, as member() gives
 *       it; 0 when a is empty).
 */
#include "native_tracking.h"

#include <stdint.h>

/* -1 when x is strictly ascending, else the first index i with x[i] <= x[i - 1]. */
static Py_ssize_t first_unordered(const int64_t *x, Py_ssize_t n) {
    for (Py_ssize_t i = 1; i < n; i++)
        if (x[i] <= x[i - 1])
            return i;
    return -1;
}

static Py_ssize_t merge_run(const int64_t *a, Py_ssize_t na, const int64_t *b, Py_ssize_t nb,
                            int64_t *out, int64_t *pos_a, int64_t *b_only, int64_t *pos_b,
                            uint8_t *in_a, int64_t *at_a) {
    Py_ssize_t i = 0, j = 0, k = 0, m = 0;
    const Py_ssize_t last = na > 0 ? na - 1 : 0;
    while (i < na || j < nb) {
        if (j >= nb || (i < na && a[i] < b[j])) {
            out[k] = a[i];
            pos_a[i++] = k++;
        } else if (i < na && a[i] == b[j]) {
            in_a[j] = 1;
            at_a[j++] = i;
            out[k] = a[i];
            pos_a[i++] = k++;
        } else {
            in_a[j] = 0;
            at_a[j] = i < last ? i : last;
            b_only[m] = j;
            pos_b[m++] = k;
            out[k++] = b[j++];
        }
    }
    return m;
}

PyObject *merge_sorted(PyObject *self, PyObject *args) {
    PyObject *o[8];
    static const char *names[8] = {"a", "b", "out", "pos_a", "b_only", "pos_b", "in_a", "at_a"};
    if (!PyArg_ParseTuple(args, "OOOOOOOO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6],
                          &o[7]))
        return NULL;
    Bufs bs = {.n = 0};
    Py_buffer *v[8];
    PyObject *ret = NULL;
    for (int t = 0; t < 8; t++) {
        v[t] = take(&bs, o[t], t >= 2, names[t]);
        if (v[t] == BAD)
            goto done;
        if (!v[t]) {
            PyErr_Format(PyExc_TypeError, "%s is required", names[t]);
            goto done;
        }
    }
    if (check_item(v[0], 8, "ql", "a") < 0 || check_item(v[1], 8, "ql", "b") < 0)
        goto done;
    Py_ssize_t na = v[0]->len / 8, nb = v[1]->len / 8;
    if (check_items(v[2], na + nb, 8, "ql", "out") < 0 || check_items(v[3], na, 8, "ql", "pos_a") < 0
        || check_items(v[4], nb, 8, "ql", "b_only") < 0
        || check_items(v[5], nb, 8, "ql", "pos_b") < 0
        || check_items(v[6], nb, 1, "?bB", "in_a") < 0
        || check_items(v[7], nb, 8, "ql", "at_a") < 0)
        goto done;
    for (int t = 0; t < 2; t++) {
        Py_ssize_t bad = first_unordered((const int64_t *)v[t]->buf, v[t]->len / 8);
        if (bad >= 0) {
            PyErr_Format(PyExc_ValueError, "%s: not strictly ascending at index %zd",
                         names[t], bad);
            goto done;
        }
    }
    Py_ssize_t m;
    Py_BEGIN_ALLOW_THREADS
    m = merge_run((const int64_t *)v[0]->buf, na, (const int64_t *)v[1]->buf, nb,
                  (int64_t *)v[2]->buf, (int64_t *)v[3]->buf, (int64_t *)v[4]->buf,
                  (int64_t *)v[5]->buf, (uint8_t *)v[6]->buf, (int64_t *)v[7]->buf);
    Py_END_ALLOW_THREADS
    ret = PyLong_FromSsize_t(m);
done:
    release(&bs);
    return ret;
}
