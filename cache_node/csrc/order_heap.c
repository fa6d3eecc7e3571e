/* A weighted eviction order (order.h): the lowest weight goes first, ties by arrival.
 *
 * Each block has a weight (`initial` until used); touch() adds `step` to it (LFU counts uses
 * this way) and the weights are also writable in place through the buffer protocol (the score
 * policy's attention mass, credited by numpy). As in eviction.py's reference HeapPolicy, a
 * block's rank is its weight when it was added plus an arrival tick, fixed until it leaves: an
 * indexed binary heap, O(log n) add, remove and pop, where the reference pays lazy deletion.
 */
#include "order.h" /* Python.h first: it sets the feature macros */

#include <stdlib.h>
#include <string.h>

typedef struct {
    double weight;
    uint64_t tick;
    int32_t block;
} Entry;

typedef struct {
    Order base;
    Entry *heap; /* base.count entries, a min-heap by (weight, tick) */
    Py_ssize_t heap_cap;
    Py_ssize_t cap;  /* size of pos and weight */
    int32_t *pos;    /* pos[b]: b's index in heap, -1 when not listed */
    double *weight;  /* per block */
    double initial, step;
    uint64_t tick;
    Py_ssize_t exports; /* live buffer views of weight: it must not move */
} HeapOrder;

static inline int less(const Entry *a, const Entry *b)
{
    return a->weight < b->weight || (a->weight == b->weight && a->tick < b->tick);
}

static int grow(HeapOrder *h, Py_ssize_t need)
{
    if (need <= h->cap)
        return 0;
    if (h->exports > 0) {
        PyErr_Format(PyExc_BufferError, "block %zd is outside the %zd weights a view holds", need - 1, h->cap);
        return -1;
    }
    Py_ssize_t cap = h->cap ? h->cap : 64;
    while (cap < need)
        cap *= 2;
    int32_t *pos = PyMem_Realloc(h->pos, cap * sizeof(int32_t));
    if (pos == NULL)
        return PyErr_NoMemory(), -1;
    h->pos = pos;
    double *weight = PyMem_Realloc(h->weight, cap * sizeof(double));
    if (weight == NULL)
        return PyErr_NoMemory(), -1;
    h->weight = weight;
    for (Py_ssize_t b = h->cap; b < cap; b++) {
        pos[b] = -1;
        weight[b] = h->initial;
    }
    h->cap = cap;
    return 0;
}

static inline void place(HeapOrder *h, Py_ssize_t i, Entry e)
{
    h->heap[i] = e;
    h->pos[e.block] = (int32_t)i;
}

static void sift_up(HeapOrder *h, Py_ssize_t i)
{
    Entry e = h->heap[i];
    while (i > 0) {
        Py_ssize_t parent = (i - 1) / 2;
        if (!less(&e, &h->heap[parent]))
            break;
        place(h, i, h->heap[parent]);
        i = parent;
    }
    place(h, i, e);
}

static void sift_down(HeapOrder *h, Py_ssize_t i)
{
    Py_ssize_t n = h->base.count;
    Entry e = h->heap[i];
    for (;;) {
        Py_ssize_t child = 2 * i + 1;
        if (child >= n)
            break;
        if (child + 1 < n && less(&h->heap[child + 1], &h->heap[child]))
            child++;
        if (!less(&h->heap[child], &e))
            break;
        place(h, i, h->heap[child]);
        i = child;
    }
    place(h, i, e);
}

static int heap_add(Order *o, Py_ssize_t b)
{
    HeapOrder *h = (HeapOrder *)o;
    if (grow(h, b + 1) < 0)
        return -1;
    if (o->count == h->heap_cap) {
        Py_ssize_t cap = h->heap_cap ? 2 * h->heap_cap : 64;
        Entry *heap = PyMem_Realloc(h->heap, cap * sizeof(Entry));
        if (heap == NULL)
            return PyErr_NoMemory(), -1;
        h->heap = heap;
        h->heap_cap = cap;
    }
    Entry e = {h->weight[b], h->tick++, (int32_t)b};
    place(h, o->count++, e);
    sift_up(h, o->count - 1);
    return 0;
}

static void heap_remove(Order *o, Py_ssize_t b)
{
    HeapOrder *h = (HeapOrder *)o;
    Py_ssize_t i = h->pos[b], last = --o->count;
    h->pos[b] = -1;
    if (i != last) { /* the last entry fills the hole, then moves down or up */
        Entry moved = h->heap[last];
        place(h, i, moved);
        sift_down(h, i);
        if (h->pos[moved.block] == i)
            sift_up(h, i);
    }
}

static Py_ssize_t heap_pop(Order *o)
{
    Py_ssize_t b = ((HeapOrder *)o)->heap[0].block;
    heap_remove(o, b);
    return b;
}

static int heap_has(const Order *o, Py_ssize_t b)
{
    const HeapOrder *h = (const HeapOrder *)o;
    return b < h->cap && h->pos[b] >= 0;
}

static int heap_touch(Order *o, Py_ssize_t b)
{
    HeapOrder *h = (HeapOrder *)o;
    if (h->step == 0.0)
        return 0;
    if (grow(h, b + 1) < 0)
        return -1;
    h->weight[b] += h->step;
    return 0;
}

static void heap_forget(Order *o, Py_ssize_t b)
{
    HeapOrder *h = (HeapOrder *)o;
    if (b < h->cap)
        h->weight[b] = h->initial;
}

static int by_rank(const void *a, const void *b)
{
    const Entry *x = a, *y = b;
    return less(x, y) ? -1 : less(y, x) ? 1 : 0;
}

static PyObject *heap_victims(Order *o)
{
    HeapOrder *h = (HeapOrder *)o;
    Py_ssize_t n = o->count;
    Entry *sorted = PyMem_Malloc((n ? n : 1) * sizeof(Entry));
    if (sorted == NULL)
        return PyErr_NoMemory();
    memcpy(sorted, h->heap, n * sizeof(Entry));
    qsort(sorted, n, sizeof(Entry), by_rank);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *v = PyLong_FromLong(sorted[i].block);
        if (v == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, v);
    }
    PyMem_Free(sorted);
    return out;
}

static const OrderOps heap_ops = {heap_add, heap_remove, heap_pop, heap_has, heap_touch, heap_forget, heap_victims};

static PyObject *heap_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"num_blocks", "initial", "step", NULL};
    Py_ssize_t num_blocks = 0;
    double initial = 0.0, step = 0.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|ndd:HeapOrder", kwlist, &num_blocks, &initial, &step))
        return NULL;
    if (num_blocks < 0 || num_blocks > PKV_MAX_BLOCKS) {
        PyErr_SetString(PyExc_ValueError, "HeapOrder needs 0 <= num_blocks < 2**31 - 1");
        return NULL;
    }
    HeapOrder *h = (HeapOrder *)type->tp_alloc(type, 0);
    if (h == NULL)
        return NULL;
    h->base.ops = &heap_ops;
    h->initial = initial;
    h->step = step;
    if (grow(h, num_blocks ? num_blocks : 1) < 0) {
        Py_DECREF(h);
        return NULL;
    }
    return (PyObject *)h;
}

/* add_mass(block, mass): the block's weight grows by mass (the score policy's credit). */
static PyObject *heap_add_mass(HeapOrder *h, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "add_mass(block, mass)");
        return NULL;
    }
    Py_ssize_t b = pkv_block_arg(args[0]);
    double mass = PyFloat_AsDouble(args[1]);
    if (b < 0 || (mass == -1.0 && PyErr_Occurred()) || grow(h, b + 1) < 0)
        return NULL;
    h->weight[b] += mass;
    Py_RETURN_NONE;
}

static PyObject *heap_weight_of(HeapOrder *h, PyObject *arg)
{
    Py_ssize_t b = pkv_block_arg(arg);
    if (b < 0)
        return NULL;
    return PyFloat_FromDouble(b < h->cap ? h->weight[b] : h->initial);
}

/* The weights as a writable buffer of doubles (numpy.frombuffer(order, numpy.float64)). */
static int heap_getbuffer(HeapOrder *h, Py_buffer *view, int flags)
{
    if (PyBuffer_FillInfo(view, (PyObject *)h, h->weight, h->cap * (Py_ssize_t)sizeof(double), 0, flags) < 0)
        return -1;
    h->exports++;
    return 0;
}

static void heap_releasebuffer(HeapOrder *h, Py_buffer *view) { h->exports--; }

static void heap_dealloc(HeapOrder *h)
{
    PyObject_GC_UnTrack(h);
    pkv_order_clear(&h->base);
    PyMem_Free(h->heap);
    PyMem_Free(h->pos);
    PyMem_Free(h->weight);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

static PyMethodDef heap_methods[] = {
    {"add_mass", (PyCFunction)(void (*)(void))heap_add_mass, METH_FASTCALL,
     "add_mass(block, mass): the block's weight grows by mass."},
    {"weight_of", (PyCFunction)heap_weight_of, METH_O, "weight_of(block) -> its current weight."},
    {NULL, NULL, 0, NULL},
};

static PyBufferProcs heap_as_buffer = {
    (getbufferproc)heap_getbuffer,
    (releasebufferproc)heap_releasebuffer,
};

PyTypeObject pkv_HeapOrderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_block_core.HeapOrder",
    .tp_basicsize = sizeof(HeapOrder),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "HeapOrder(num_blocks=0, initial=0.0, step=0.0): the lowest weight first, ties by arrival.",
    .tp_base = &pkv_OrderType,
    .tp_methods = heap_methods,
    .tp_as_buffer = &heap_as_buffer,
    .tp_new = heap_new,
    .tp_dealloc = (destructor)heap_dealloc,
    .tp_traverse = (traverseproc)pkv_order_traverse,
    .tp_clear = (inquiry)pkv_order_clear,
};
