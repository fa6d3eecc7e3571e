/* The eviction order: the interface between the compiled policies and the compiled pool.
 *
 * An order ranks the evictable blocks of one pool (unreferenced, keyed, not pinned) and
 * nothing else: the pool (pool.c) decides what enters and leaves the set and drives the
 * order through the function table below, without a Python call per block. Each order is
 * also a Python object whose methods (defined once, in order_base.c, over the same table)
 * are what cache_node/eviction.py's policies delegate to, so a policy called from Python
 * and the pool's C loops see one state.
 *
 * Implementations: order_list.c (LRU, and SLRU's two segments with a ghost list of evicted
 * keys) and order_heap.c (a weight captured when a block is added, ties by arrival: LFU
 * and attention score). Block ids are ints in [0, 2**31 - 1); per-block arrays grow on use.
 */
#ifndef PAGEDKV_ORDER_H
#define PAGEDKV_ORDER_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define PKV_MAX_BLOCKS ((Py_ssize_t)INT32_MAX)

typedef struct Order Order;

typedef struct {
    /* b became evictable; b is not listed. 0, or -1 with an exception set. */
    int (*add)(Order *o, Py_ssize_t b);
    /* b stops being evictable; b is listed. */
    void (*remove)(Order *o, Py_ssize_t b);
    /* Remove and return the next victim; the order is not empty. -1 with an exception on failure. */
    Py_ssize_t (*pop)(Order *o);
    /* Whether b is listed (any b >= 0). */
    int (*has)(const Order *o, Py_ssize_t b);
    /* A use of b (a prefix hit), listed or not. 0, or -1 with an exception set. */
    int (*touch)(Order *o, Py_ssize_t b);
    /* b's history ends (it was evicted, or freed without a key). */
    void (*forget)(Order *o, Py_ssize_t b);
    /* A new list of the listed blocks in the order they would be evicted (no demotions). */
    PyObject *(*victims)(Order *o);
} OrderOps;

struct Order {
    PyObject_HEAD
    const OrderOps *ops;
    Py_ssize_t count; /* listed blocks */
    PyObject *key_of; /* the pool's block -> key list (read, never written), or NULL before bind_keys */
};

extern PyTypeObject pkv_OrderType;     /* the base type: the Python methods, over ops */
extern PyTypeObject pkv_LRUOrderType;  /* order_list.c */
extern PyTypeObject pkv_SLRUOrderType; /* order_list.c */
extern PyTypeObject pkv_HeapOrderType; /* order_heap.c */

#define PKV_IS_ORDER(o) PyObject_TypeCheck((o), &pkv_OrderType)

/* The key of block b in the bound key list (a borrowed reference, Py_None when unbound or out of range). */
static inline PyObject *pkv_order_key(const Order *o, Py_ssize_t b)
{
    if (o->key_of == NULL || b >= PyList_GET_SIZE(o->key_of))
        return Py_None;
    return PyList_GET_ITEM(o->key_of, b);
}

/* A block id from a Python int: >= 0, or -1 with an exception set (TypeError, ValueError). */
Py_ssize_t pkv_block_arg(PyObject *arg);

/* Base-type GC helpers for subtypes that hold more references. */
int pkv_order_traverse(Order *o, visitproc visit, void *arg);
int pkv_order_clear(Order *o);

#endif
