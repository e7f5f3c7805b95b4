/* Buffer arguments of deltastream's C extensions (tracking, publishing and embedding
 * native.c): each takes numpy arrays through the buffer protocol, checks their element
 * type and size, and releases them together on the way out.
 *
 *   Bufs bs = {.n = 0};
 *   Py_buffer *x = take(&bs, obj, writable, "x");   NULL for None, BAD on error (set)
 *   if (check_item(x, 8, "ql", "x") < 0) ...        itemsize and format code
 *   if (check_at(at, rows, "at") < 0) ...           an int64 row index, each in [0, rows)
 *   if (check_ids(ids, wide, n, cap, "ids", ": position", "") < 0) ...   ids in [0, cap)
 *   release(&bs);
 */
#ifndef DELTASTREAM_NATIVE_BUFFERS_H
#define DELTASTREAM_NATIVE_BUFFERS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

/* The buffer's one-character struct format code ('?' when it has more than one). */
static inline char code_of(const Py_buffer *v) {
    const char *f = v->format ? v->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    return f[0] && !f[1] ? f[0] : '?';
}

static inline int get_buf(PyObject *obj, Py_buffer *v, int writable, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, v, flags) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: expected a C-contiguous%s array", what,
                     writable ? " writable" : "");
        return -1;
    }
    return 0;
}

/* Buffers of one call, released together. */
typedef struct {
    Py_buffer b[10]; /* the most one call takes */
    int n;
} Bufs;

#define BAD ((Py_buffer *)-1) /* take() failed (an error is set) */

static inline Py_buffer *take(Bufs *bs, PyObject *obj, int writable, const char *what) {
    if (obj == Py_None)
        return NULL;
    if (bs->n >= (int)(sizeof bs->b / sizeof bs->b[0])) {
        PyErr_SetString(PyExc_SystemError, "native: too many buffers in one call");
        return BAD;
    }
    Py_buffer *v = &bs->b[bs->n];
    if (get_buf(obj, v, writable, what) < 0)
        return BAD;
    bs->n++;
    return v;
}

static inline void release(Bufs *bs) {
    for (int i = 0; i < bs->n; i++)
        PyBuffer_Release(&bs->b[i]);
}

/* v's items are `size` bytes with a format code in `codes`, else a ValueError naming it. */
static inline int check_item(const Py_buffer *v, Py_ssize_t size, const char *codes, const char *what) {
    char c = code_of(v);
    if (v->itemsize != size || !strchr(codes, c)) {
        PyErr_Format(PyExc_ValueError, "%s: wrong element type (format %s, %zd bytes)", what,
                     v->format ? v->format : "B", v->itemsize);
        return -1;
    }
    return 0;
}

/* check_item, and v holds exactly n items. */
static inline int check_items(const Py_buffer *v, Py_ssize_t n, Py_ssize_t size, const char *codes,
                       const char *what) {
    if (check_item(v, size, codes, what) < 0)
        return -1;
    if (v->len != n * size) {
        PyErr_Format(PyExc_ValueError, "%s: %zd items, expected %zd", what, v->len / size, n);
        return -1;
    }
    return 0;
}

/* The first index of an id outside [0, capacity) (int64 ids when wide, else int32), or -1:
 * one branch-free pass when every id is in range. */
static inline Py_ssize_t first_out_of_range(const void *ids, int wide, Py_ssize_t n,
                                            uint64_t capacity) {
    uint64_t bad = 0;
    if (wide) {
        const int64_t *q = (const int64_t *)ids;
        for (Py_ssize_t i = 0; i < n; i++)
            bad |= (uint64_t)q[i] >= capacity;
    } else {
        const int32_t *q = (const int32_t *)ids;
        for (Py_ssize_t i = 0; i < n; i++)
            bad |= (uint64_t)(int64_t)q[i] >= capacity;
    }
    if (!bad)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t id = wide ? ((const int64_t *)ids)[i] : ((const int32_t *)ids)[i];
        if ((uint64_t)id >= capacity)
            return i;
    }
    return -1;
}

/* n ids (int64 when wide, else int32) all in [0, capacity); else -1 with an IndexError
 * naming the first bad one: "<what><noun> <id> (at <i>) is outside <where>[0, capacity)". */
static inline int check_ids(const void *ids, int wide, Py_ssize_t n, uint64_t capacity,
                            const char *what, const char *noun, const char *where) {
    Py_ssize_t bad = first_out_of_range(ids, wide, n, capacity);
    if (bad < 0)
        return 0;
    long long id = wide ? ((const int64_t *)ids)[bad] : ((const int32_t *)ids)[bad];
    PyErr_Format(PyExc_IndexError, "%s%s %lld (at %zd) is outside %s[0, %llu)", what, noun, id,
                 bad, where, (unsigned long long)capacity);
    return -1;
}

/* A row index array (int64; NULL for None passes) whose entries all lie in [0, rows); else
 * -1 with a ValueError (element type) or an IndexError naming it and the first bad entry. */
static inline int check_at(const Py_buffer *at, Py_ssize_t rows, const char *what) {
    if (!at)
        return 0;
    if (check_item(at, 8, "ql", what) < 0)
        return -1;
    return check_ids(at->buf, 1, at->len / 8, (uint64_t)rows, what, ": row", "");
}

#endif
