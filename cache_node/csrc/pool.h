/* The compiled block pool (pool.c: its loops; pool_type.c: construction, queries and the
 * Python type). See pool.c for what a Pool owns. */
#ifndef PAGEDKV_POOL_H
#define PAGEDKV_POOL_H

#include "order.h"

typedef struct {
    PyObject_HEAD
    Py_ssize_t n;
    int32_t *refcount;
    int32_t *pins;       /* pin counts */
    int32_t *free_stack; /* never-keyed unreferenced blocks; the top is taken first */
    Py_ssize_t nfree;
    PyObject *key_of;       /* list: block -> key or None */
    PyObject *block_of_key; /* dict: key -> block */
    PyObject *ids;          /* tuple(range(n)) */
    PyObject *policy;       /* a compiled Order, or a Python policy */
    Order *order;           /* policy when it is a compiled Order, else NULL */
    Py_ssize_t num_evictions;
} Pool;

extern PyTypeObject pkv_PoolType;
extern PyTypeObject pkv_DecodeGroupType; /* decode_group.c */
int pkv_decode_group_ready(void);        /* its constants and PyType_Ready: 0 or -1 */
extern PyTypeObject pkv_LifecycleType;   /* lifecycle.c */
int pkv_lifecycle_ready(void);           /* its names: 0 or -1 */

int pkv_pool_names(void); /* the policy method names, interned once: 0 or -1 */
Py_ssize_t pkv_pool_block(Pool *p, PyObject *o);
Py_ssize_t pkv_pool_evictable(Pool *p);

/* The methods (pool.c), as the type's method table names them. */
PyObject *pkv_pool_take(Pool *p, PyObject *const *args, Py_ssize_t nargs);
PyObject *pkv_pool_release(Pool *p, PyObject *const *args, Py_ssize_t nargs);
PyObject *pkv_pool_incref(Pool *p, PyObject *arg);
PyObject *pkv_pool_acquire(Pool *p, PyObject *blocks);
PyObject *pkv_pool_publish(Pool *p, PyObject *const *args, Py_ssize_t nargs);
PyObject *pkv_pool_publish_many(Pool *p, PyObject *const *args, Py_ssize_t nargs);
PyObject *pkv_pool_drop(Pool *p, PyObject *arg);
PyObject *pkv_pool_lookup(Pool *p, PyObject *key);
PyObject *pkv_pool_match(Pool *p, PyObject *keys);
PyObject *pkv_pool_pin(Pool *p, PyObject *arg);
PyObject *pkv_pool_unpin(Pool *p, PyObject *arg);

#endif
