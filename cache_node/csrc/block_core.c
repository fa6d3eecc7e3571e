/* `_block_core`: the block pool's compiled core, a CPython extension module built at first use
 * by cache_node/block_core.py from this directory's sources:
 *
 *   order.h, order_base.c   the eviction-order interface and its Python methods
 *   order_list.c            LRU and SLRU orders (linked lists over block ids)
 *   order_heap.c            weighted orders: LFU and attention score (an indexed heap)
 *   pool.h, pool.c          a tier's block state (refcounts, free stack, keys, pins) and loops
 *   pool_type.c             the pool's construction, queries and Python type
 *   decode_group.c          a decode step for a batch, taking blocks off a pool's free stack
 *   lifecycle.c             a sequence's open, reserve and free without prefix caching
 *   block_core.c            this module: the types, and one block's key by the compiled chain
 *
 * Everything here owns the state it works on and reaches Python objects through the public
 * C API only; the Python modules (block_pool.py, eviction.py) are the reference it is tested
 * against, step by step (tests/unit/test_block_core*.py).
 */
#include "pool.h"

#define ABI_VERSION 13

/* The compiled key chain of protos/csrc/chain_keys.c (pagedkv_chain_keys), whose address the
 * loader passes in once it has loaded that library: a direct call, without ctypes' cost. */
typedef int64_t (*chain_keys_fn)(const uint8_t *parent, const uint8_t *tokens, int64_t block_size,
                                 int64_t num_blocks, uint8_t *out);
static chain_keys_fn chain_keys = NULL;

static PyObject *set_chain(PyObject *self, PyObject *arg)
{
    void *address = PyLong_AsVoidPtr(arg);
    if (address == NULL && PyErr_Occurred())
        return NULL;
    chain_keys = (chain_keys_fn)address;
    Py_RETURN_NONE;
}

/* block_key(parent, tokens, first, block_size) -> bytes
 *
 * The key of the block tokens[first:first + block_size] under `parent` (16 bytes):
 * chain_keys(parent, tokens[first:first + block_size], block_size)[0], hashed by the compiled
 * chain without slicing or packing in Python (a decode step that fills a block). */
static PyObject *block_key(PyObject *self, PyObject *args)
{
    const char *parent;
    Py_ssize_t parent_len, first, bs;
    PyObject *tokens;
    if (!PyArg_ParseTuple(args, "y#Onn", &parent, &parent_len, &tokens, &first, &bs))
        return NULL;
    if (chain_keys == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "block_key: no compiled key chain was set");
        return NULL;
    }
    if (!PyList_Check(tokens)) {
        PyErr_SetString(PyExc_TypeError, "block_key: tokens must be a list");
        return NULL;
    }
    if (parent_len != 16 || bs <= 0 || bs > 4096 || first < 0 || first + bs > PyList_GET_SIZE(tokens)) {
        PyErr_SetString(PyExc_ValueError, "block_key: a 16-byte parent and a whole block inside the list");
        return NULL;
    }
    uint8_t packed[8 * 4096];
    for (Py_ssize_t i = 0; i < bs; i++) {
        long long v = PyLong_AsLongLong(PyList_GET_ITEM(tokens, first + i));
        if (v == -1 && PyErr_Occurred())
            return NULL;
        uint64_t u = (uint64_t)v;
        for (int b = 0; b < 8; b++)
            packed[8 * i + b] = (uint8_t)(u >> (8 * b)); /* little-endian int64 */
    }
    uint8_t out[16];
    if (chain_keys((const uint8_t *)parent, packed, bs, 1, out) != 0) {
        PyErr_SetString(PyExc_ValueError, "block_key: the key chain refused the block");
        return NULL;
    }
    return PyBytes_FromStringAndSize((const char *)out, 16);
}

static PyMethodDef methods[] = {
    {"set_chain", set_chain, METH_O, "Give the address of pagedkv_chain_keys; see block_core.c."},
    {"block_key", block_key, METH_VARARGS, "One block's key by the compiled chain; see block_core.c."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_block_core", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__block_core(void)
{
    if (pkv_pool_names() < 0 || pkv_decode_group_ready() < 0 || pkv_lifecycle_ready() < 0)
        return NULL;
    PyTypeObject *types[] = {&pkv_OrderType, &pkv_LRUOrderType, &pkv_SLRUOrderType, &pkv_HeapOrderType,
                             &pkv_PoolType, &pkv_DecodeGroupType, &pkv_LifecycleType};
    const char *names[] = {"Order", "LRUOrder", "SLRUOrder", "HeapOrder", "Pool", "DecodeGroup", "Lifecycle"};
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++)
        if (PyType_Ready(types[i]) < 0)
            return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "ABI_VERSION", ABI_VERSION) < 0)
        goto fail;
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++)
        if (PyModule_AddObjectRef(m, names[i], (PyObject *)types[i]) < 0)
            goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
