/* The compiled pool's construction, its queries (which change nothing) and its Python type;
 * the loops are in pool.c. */
#include "pool.h"

static PyObject *pool_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"num_blocks", "policy", NULL};
    Py_ssize_t n;
    PyObject *policy;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nO:Pool", kwlist, &n, &policy))
        return NULL;
    if (n < 0 || n >= PKV_MAX_BLOCKS) {
        PyErr_Format(PyExc_ValueError, "a pool holds 0 to %zd blocks, not %zd", PKV_MAX_BLOCKS - 1, n);
        return NULL;
    }
    Pool *p = (Pool *)type->tp_alloc(type, 0); /* zeroed */
    if (p == NULL)
        return NULL;
    p->n = n;
    p->policy = Py_NewRef(policy);
    p->order = PKV_IS_ORDER(policy) ? (Order *)policy : NULL;
    size_t size = (size_t)(n ? n : 1) * sizeof(int32_t);
    p->refcount = PyMem_Calloc(1, size);
    p->pins = PyMem_Calloc(1, size);
    p->free_stack = PyMem_Malloc(size);
    if (p->refcount == NULL || p->pins == NULL || p->free_stack == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) /* popped from the top: block 0 is handed out first */
        p->free_stack[i] = (int32_t)(n - 1 - i);
    p->nfree = n;
    if ((p->key_of = PyList_New(n)) == NULL || (p->ids = PyTuple_New(n)) == NULL ||
        (p->block_of_key = PyDict_New()) == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *id = PyLong_FromSsize_t(i);
        if (id == NULL)
            goto fail;
        PyTuple_SET_ITEM(p->ids, i, id);
        PyList_SET_ITEM(p->key_of, i, Py_NewRef(Py_None));
    }
    return (PyObject *)p;
fail:
    Py_DECREF(p);
    return NULL;
}

static int pool_traverse(Pool *p, visitproc visit, void *arg)
{
    Py_VISIT(p->policy);
    Py_VISIT(p->key_of);
    Py_VISIT(p->block_of_key);
    return 0;
}

static int pool_clear(Pool *p)
{
    p->order = NULL;
    Py_CLEAR(p->policy);
    Py_CLEAR(p->key_of);
    Py_CLEAR(p->block_of_key);
    Py_CLEAR(p->ids);
    return 0;
}

static void pool_dealloc(Pool *p)
{
    PyObject_GC_UnTrack(p);
    pool_clear(p);
    PyMem_Free(p->refcount);
    PyMem_Free(p->pins);
    PyMem_Free(p->free_stack);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

/* ---- queries: none changes anything ---- */

static PyObject *pool_refcount_of(Pool *p, PyObject *arg)
{
    Py_ssize_t b = pkv_pool_block(p, arg);
    return b < 0 ? NULL : PyLong_FromLong(p->refcount[b]);
}

static PyObject *pool_pin_count(Pool *p, PyObject *arg)
{
    Py_ssize_t b = pkv_pool_block(p, arg);
    return b < 0 ? NULL : PyLong_FromLong(p->pins[b]);
}

static PyObject *pool_key(Pool *p, PyObject *arg)
{
    Py_ssize_t b = pkv_pool_block(p, arg);
    return b < 0 ? NULL : Py_NewRef(PyList_GET_ITEM(p->key_of, b));
}

/* num_releasable(blocks): how many of these blocks one release each would make allocatable
 * (their last reference, and no key or no pin). */
static PyObject *pool_num_releasable(Pool *p, PyObject *blocks)
{
    PyObject *seq = PySequence_Fast(blocks, "num_releasable() takes a sequence of blocks");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = 0;
    for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(seq); j++) {
        Py_ssize_t b = pkv_pool_block(p, PySequence_Fast_GET_ITEM(seq, j));
        if (b < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        count += p->refcount[b] == 1 && (PyList_GET_ITEM(p->key_of, b) == Py_None || p->pins[b] == 0);
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(count);
}

static PyObject *pool_num_pinned_idle(Pool *p, PyObject *unused)
{
    Py_ssize_t count = 0;
    for (Py_ssize_t b = 0; b < p->n; b++)
        count += p->pins[b] > 0 && p->refcount[b] == 0;
    return PyLong_FromSsize_t(count);
}

static PyObject *int_list(const int32_t *values, Py_ssize_t n, int reversed)
{
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *v = PyLong_FromLong(values[reversed ? n - 1 - i : i]);
        if (v == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, v);
    }
    return out;
}

static PyObject *pool_refcounts(Pool *p, PyObject *unused) { return int_list(p->refcount, p->n, 0); }

static PyObject *pool_free_list(Pool *p, PyObject *unused) { return int_list(p->free_stack, p->nfree, 0); }

static PyObject *pool_pin_counts(Pool *p, PyObject *unused)
{
    PyObject *out = PyDict_New();
    for (Py_ssize_t b = 0; out != NULL && b < p->n; b++) {
        if (p->pins[b] == 0)
            continue;
        PyObject *count = PyLong_FromLong(p->pins[b]);
        if (count == NULL || PyDict_SetItem(out, PyTuple_GET_ITEM(p->ids, b), count) < 0)
            Py_CLEAR(out);
        Py_XDECREF(count);
    }
    return out;
}

static PyObject *get_num_free(Pool *p, void *c) { return PyLong_FromSsize_t(p->nfree); }

static PyObject *get_num_evictable(Pool *p, void *c)
{
    Py_ssize_t n = pkv_pool_evictable(p);
    return n < 0 ? NULL : PyLong_FromSsize_t(n);
}

static PyObject *get_num_evictions(Pool *p, void *c) { return PyLong_FromSsize_t(p->num_evictions); }

static PyObject *get_key_list(Pool *p, void *c) { return Py_NewRef(p->key_of); }

static PyObject *get_key_map(Pool *p, void *c) { return Py_NewRef(p->block_of_key); }

#define FAST(name, doc) {#name, (PyCFunction)(void (*)(void))pkv_pool_##name, METH_FASTCALL, doc}
#define ONE(name, fn, doc) {#name, (PyCFunction)fn, METH_O, doc}
#define NONE(name, fn, doc) {#name, (PyCFunction)fn, METH_NOARGS, doc}

static PyMethodDef pool_methods[] = {
    FAST(take, "take(n, evicted_keys) -> blocks, or None when fewer than n are available."),
    FAST(release, "release(blocks, reverse) -> None, or the first block released more often than held."),
    ONE(incref, pkv_pool_incref, "incref(block): a reference; an evictable block stops being one."),
    ONE(acquire, pkv_pool_acquire, "acquire(blocks): a prefix hit: a reference and a use each."),
    FAST(publish, "publish(block, key) -> whether the block took the key."),
    FAST(publish_many, "publish_many(blocks, keys) -> the keys published, in order."),
    ONE(drop, pkv_pool_drop, "drop(block) -> its key or None: an idle block becomes free."),
    ONE(lookup, pkv_pool_lookup, "lookup(key) -> block or None."),
    ONE(match, pkv_pool_match, "match(keys) -> the blocks of the longest prefix held."),
    ONE(pin, pkv_pool_pin, "pin(block) -> False when it has no key."),
    ONE(unpin, pkv_pool_unpin, "unpin(block) -> False when it is not pinned."),
    ONE(refcount_of, pool_refcount_of, "refcount_of(block) -> int."),
    ONE(pin_count, pool_pin_count, "pin_count(block) -> int."),
    ONE(key, pool_key, "key(block) -> its key or None."),
    ONE(num_releasable, pool_num_releasable, "num_releasable(blocks) -> how many one release frees."),
    NONE(num_pinned_idle, pool_num_pinned_idle, "Pinned blocks nobody references (O(n))."),
    NONE(refcounts, pool_refcounts, "Every block's refcount, as a new list (O(n))."),
    NONE(free_list, pool_free_list, "The free stack, bottom first, as a new list (O(n))."),
    NONE(pin_counts, pool_pin_counts, "{block: pin count} for pinned blocks, a new dict (O(n))."),
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef pool_getset[] = {
    {"num_free", (getter)get_num_free, NULL, "Blocks with no key and no reference.", NULL},
    {"num_evictable", (getter)get_num_evictable, NULL, "Blocks the policy may evict.", NULL},
    {"num_evictions", (getter)get_num_evictions, NULL, "Blocks evicted by take() so far.", NULL},
    {"key_list", (getter)get_key_list, NULL, "The block -> key list itself (read it, never write it).", NULL},
    {"key_map", (getter)get_key_map, NULL, "The key -> block dict itself (read it, never write it).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject pkv_PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_block_core.Pool",
    .tp_basicsize = sizeof(Pool),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Pool(num_blocks, policy): one tier's block state and loops; see pool.c.",
    .tp_new = pool_new,
    .tp_dealloc = (destructor)pool_dealloc,
    .tp_traverse = (traverseproc)pool_traverse,
    .tp_clear = (inquiry)pool_clear,
    .tp_methods = pool_methods,
    .tp_getset = pool_getset,
};
