/* deltastream.embedding.native: HashIndex probes and inserts on the CPU, one id at a time.
 *
 * The torch twin, and the slot layout, are deltastream/embedding/hash_index.py and
 * deltastream/kernels/hash_layout.py (read them first); a test runs both on the same ids and
 * compares. torch resolves a batch in probing rounds of about ten whole-batch operations
 * each (gathers, compares, compactions), each allocating its result and holding the GIL
 * between them; a batch of a few thousand ids, what a training step looks up, pays more
 * for those calls than for the probes. Here each id walks its chain directly, the home slots
 * of the ids ahead are prefetched (a large index is all cache misses), and the GIL is
 * released.
 *
 * Python API (buffers: C-contiguous int64 numpy arrays; tab_keys and tab_vals the index's
 * two arrays, S = their length, a power of two; shift = 64 - log2(S)):
 *   probe(tab_keys, tab_vals, keys, shift, out_pos, out_slots) -> None
 *       out_pos[i]: the row position of keys[i], -1 if absent; out_slots (or None): the
 *       slot holding it (valid where out_pos[i] >= 0). A probe ends at the slot holding
 *       the id (live, or DELETED: absent), at an EMPTY slot, or after every slot (an
 *       index with no EMPTY slot left: the owner keeps its load at most 1/2).
 *   insert(tab_keys, tab_vals, keys, positions, shift) -> reused
 *       Adds absent, unique keys (room ensured by the caller: at least one free slot per
 *       key) at the first free (EMPTY or DELETED) slot of each one's chain; returns how
 *       many DELETED slots were reused. With no free slot left, nothing more is written and
 *       a ValueError says so.
 */
#include "../native_buffers.h"

#include <stdint.h>

#if defined(__GNUC__)
#define PREFETCH(p) __builtin_prefetch((const void *)(p), 0, 3)
#else
#define PREFETCH(p) ((void)0)
#endif

#define EMPTY (-1)
#define DELETED (-2)
#define GOLDEN 0x9E3779B97F4A7C15ULL
#define AHEAD 16 /* ids between the prefetch of a home slot and its probe */

/* take() of an int64 array (or None: *out NULL, *len 0); -1 with an error set. */
static int take_i64(Bufs *bs, PyObject *obj, int writable, const char *what, int64_t **out,
                    Py_ssize_t *len) {
    Py_buffer *v = take(bs, obj, writable, what);
    if (v == BAD || (v && check_item(v, 8, "lq", what) < 0))
        return -1;
    *out = v ? (int64_t *)v->buf : NULL;
    *len = v ? v->len / 8 : 0;
    return 0;
}

/* The index's slot count S (a power of two, equal for both arrays, matching shift) or -1
 * with an error set. */
static Py_ssize_t check_table(Py_ssize_t nk, Py_ssize_t nv, int shift) {
    if (nk != nv || nk < 1 || (nk & (nk - 1)) || shift < 1 || shift > 63 ||
        ((uint64_t)1 << (64 - shift)) != (uint64_t)nk) {
        PyErr_Format(PyExc_ValueError,
                     "index arrays of %zd and %zd slots with shift %d: expected one power-of-two "
                     "slot count S and shift = 64 - log2(S)",
                     nk, nv, shift);
        return -1;
    }
    return nk;
}

static inline uint64_t home(int64_t key, int shift) {
    return ((uint64_t)key * GOLDEN) >> shift;
}

static PyObject *probe(PyObject *self, PyObject *args) {
    PyObject *tk_o, *tv_o, *k_o, *pos_o, *slot_o;
    int shift;
    if (!PyArg_ParseTuple(args, "OOOiOO", &tk_o, &tv_o, &k_o, &shift, &pos_o, &slot_o))
        return NULL;
    Bufs bs = {.n = 0};
    PyObject *ret = NULL;
    int64_t *tk, *tv, *keys, *pos, *slots;
    Py_ssize_t nk, nv, n, npos, nslot;
    if (take_i64(&bs, tk_o, 0, "tab_keys", &tk, &nk) ||
        take_i64(&bs, tv_o, 0, "tab_vals", &tv, &nv) || take_i64(&bs, k_o, 0, "keys", &keys, &n) ||
        take_i64(&bs, pos_o, 1, "out_pos", &pos, &npos) ||
        take_i64(&bs, slot_o, 1, "out_slots", &slots, &nslot))
        goto done;
    if (check_table(nk, nv, shift) < 0)
        goto done;
    if (!tk || !tv || !keys || !pos || npos != n || (slots && nslot != n)) {
        PyErr_Format(PyExc_ValueError, "out_pos/out_slots: %zd/%zd items for %zd keys", npos,
                     nslot, n);
        goto done;
    }
    const uint64_t mask = (uint64_t)nk - 1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            uint64_t h = home(keys[i + AHEAD], shift);
            PREFETCH(&tk[h]);
            PREFETCH(&tv[h]);
        }
        const int64_t key = keys[i];
        uint64_t s = home(key, shift);
        int64_t p = -1, at = -1;
        for (uint64_t steps = 0; steps <= mask; steps++) { /* a full index ends the walk */
            const int64_t v = tv[s];
            if (tk[s] == key) { /* the id's slot: live, or DELETED (absent) */
                p = v < 0 ? -1 : v;
                at = (int64_t)s;
                break;
            }
            if (v == EMPTY)
                break;
            s = (s + 1) & mask;
        }
        pos[i] = p;
        if (slots)
            slots[i] = p >= 0 ? at : -1;
    }
    Py_END_ALLOW_THREADS
    ret = Py_NewRef(Py_None);
done:
    release(&bs);
    return ret;
}

static PyObject *insert(PyObject *self, PyObject *args) {
    PyObject *tk_o, *tv_o, *k_o, *p_o;
    int shift;
    if (!PyArg_ParseTuple(args, "OOOOi", &tk_o, &tv_o, &k_o, &p_o, &shift))
        return NULL;
    Bufs bs = {.n = 0};
    PyObject *ret = NULL;
    int64_t *tk, *tv, *keys, *positions;
    Py_ssize_t nk, nv, n, np_;
    if (take_i64(&bs, tk_o, 1, "tab_keys", &tk, &nk) ||
        take_i64(&bs, tv_o, 1, "tab_vals", &tv, &nv) || take_i64(&bs, k_o, 0, "keys", &keys, &n) ||
        take_i64(&bs, p_o, 0, "positions", &positions, &np_))
        goto done;
    if (check_table(nk, nv, shift) < 0)
        goto done;
    if (!tk || !tv || !keys || !positions || np_ != n) {
        PyErr_Format(PyExc_ValueError, "positions: %zd items for %zd keys", np_, n);
        goto done;
    }
    const uint64_t mask = (uint64_t)nk - 1;
    Py_ssize_t reused = 0, done_n = 0;
    Py_BEGIN_ALLOW_THREADS
    for (; done_n < n; done_n++) {
        if (done_n + AHEAD < n)
            PREFETCH(&tv[home(keys[done_n + AHEAD], shift)]);
        uint64_t s = home(keys[done_n], shift), steps = 0;
        while (tv[s] >= 0 && steps <= mask) {
            s = (s + 1) & mask;
            steps++;
        }
        if (steps > mask)
            break; /* full: the caller's reserve was wrong */
        reused += tv[s] == DELETED;
        tk[s] = keys[done_n];
        tv[s] = positions[done_n];
    }
    Py_END_ALLOW_THREADS
    if (done_n < n) {
        PyErr_Format(PyExc_ValueError, "insert: no free slot left for key %lld (%zd of %zd "
                     "inserted); reserve room first", (long long)keys[done_n], done_n, n);
        goto done;
    }
    ret = PyLong_FromSsize_t(reused);
done:
    release(&bs);
    return ret;
}

static PyMethodDef methods[] = {
    {"probe", probe, METH_VARARGS,
     "probe(tab_keys, tab_vals, keys, shift, out_pos, out_slots) -> None: row position per "
     "key (-1 absent)"},
    {"insert", insert, METH_VARARGS,
     "insert(tab_keys, tab_vals, keys, positions, shift) -> reused: add absent unique keys"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "native",
                                    "HashIndex probes and inserts on the CPU.", -1, methods};

PyMODINIT_FUNC PyInit_native(void) { return PyModule_Create(&module); }
