/* The block pool's state and hot loops (cache_node/block_pool.py's compiled core).
 *
 * A Pool owns one tier's per-block state: refcounts, pin counts and the free stack in C arrays,
 * each block's key in a list (which key-aware policies may read) and the key -> block dict.
 * Its eviction order is a compiled Order (order.h), driven through its function table, or any
 * Python object with the EvictionPolicy methods, called like the reference core calls them.
 * Every method does what block_pool.py's _PythonCore does, in the same order of effects; the
 * caller (BlockPool) checks arguments and raises the domain errors. Block ids come back as the
 * ints of one tuple made at construction, so handing a block out allocates nothing.
 */
#include "pool.h"



static PyObject *s_add, *s_remove, *s_pop_victim, *s_touch, *s_forget;

int pkv_pool_names(void)
{
    s_add = PyUnicode_InternFromString("add");
    s_remove = PyUnicode_InternFromString("remove");
    s_pop_victim = PyUnicode_InternFromString("pop_victim");
    s_touch = PyUnicode_InternFromString("touch");
    s_forget = PyUnicode_InternFromString("forget");
    return s_add && s_remove && s_pop_victim && s_touch && s_forget ? 0 : -1;
}

/* ---- the policy: a compiled order's table, or the Python policy's methods ---- */

static inline PyObject *block_id(Pool *p, Py_ssize_t b) { return PyTuple_GET_ITEM(p->ids, b); }

Py_ssize_t pkv_pool_block(Pool *p, PyObject *o)
{
    Py_ssize_t b = PyLong_AsSsize_t(o);
    if (b == -1 && PyErr_Occurred())
        return -1;
    if (b < 0 || b >= p->n) {
        PyErr_Format(PyExc_IndexError, "block %zd outside the pool of %zd", b, p->n);
        return -1;
    }
    return b;
}

static int call_policy(Pool *p, PyObject *name, Py_ssize_t b)
{
    PyObject *r = PyObject_CallMethodOneArg(p->policy, name, block_id(p, b));
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

Py_ssize_t pkv_pool_evictable(Pool *p) { return p->order ? p->order->count : PyObject_Length(p->policy); }

static int policy_has(Pool *p, Py_ssize_t b)
{
    return p->order ? p->order->ops->has(p->order, b) : PySequence_Contains(p->policy, block_id(p, b));
}

static int policy_add(Pool *p, Py_ssize_t b) { return p->order ? p->order->ops->add(p->order, b) : call_policy(p, s_add, b); }

static int policy_remove(Pool *p, Py_ssize_t b)
{
    if (p->order == NULL)
        return call_policy(p, s_remove, b);
    p->order->ops->remove(p->order, b);
    return 0;
}

static int policy_touch(Pool *p, Py_ssize_t b) { return p->order ? p->order->ops->touch(p->order, b) : call_policy(p, s_touch, b); }

static int policy_forget(Pool *p, Py_ssize_t b)
{
    if (p->order == NULL)
        return call_policy(p, s_forget, b);
    p->order->ops->forget(p->order, b);
    return 0;
}

static Py_ssize_t policy_pop(Pool *p)
{
    if (p->order)
        return p->order->ops->pop(p->order);
    PyObject *r = PyObject_CallMethodNoArgs(p->policy, s_pop_victim);
    if (r == NULL)
        return -1;
    Py_ssize_t b = pkv_pool_block(p, r);
    Py_DECREF(r);
    return b;
}

/* ---- allocation ---- */

/* take(n, evicted_keys) -> list, or None (nothing changed) when fewer than n are available.
 * Free blocks first (the stack's top first), then the policy's victims, whose keys leave the
 * pool and are appended to evicted_keys in eviction order; every block gets refcount 1. */
PyObject *pkv_pool_take(Pool *p, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "take(n, evicted_keys: list)");
        return NULL;
    }
    Py_ssize_t n = PyLong_AsSsize_t(args[0]);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n <= 0)
        return PyList_New(0);
    Py_ssize_t evictable = n > p->nfree ? pkv_pool_evictable(p) : 0;
    if (evictable < 0)
        return NULL;
    if (n > p->nfree + evictable)
        Py_RETURN_NONE;
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    Py_ssize_t from_free = n < p->nfree ? n : p->nfree;
    for (Py_ssize_t j = from_free; j < n; j++) { /* every victim first, as the reference pops them */
        Py_ssize_t b = policy_pop(p);
        if (b < 0)
            goto fail;
        PyList_SET_ITEM(out, j, Py_NewRef(block_id(p, b)));
    }
    for (Py_ssize_t j = from_free; j < n; j++)
        if (policy_forget(p, PyLong_AsSsize_t(PyList_GET_ITEM(out, j))) < 0)
            goto fail;
    for (Py_ssize_t j = from_free; j < n; j++) { /* the victims' keys leave the pool */
        Py_ssize_t b = PyLong_AsSsize_t(PyList_GET_ITEM(out, j));
        PyObject *key = PyList_GET_ITEM(p->key_of, b);
        if (key == Py_None) {
            PyErr_Format(PyExc_RuntimeError, "evictable block %zd has no key", b);
            goto fail;
        }
        Py_INCREF(key);
        int r = PyDict_DelItem(p->block_of_key, key) < 0 || PyList_Append(args[1], key) < 0 ? -1 : 0;
        if (r == 0)
            PyList_SetItem(p->key_of, b, Py_NewRef(Py_None)); /* drops the list's reference */
        Py_DECREF(key);
        if (r < 0)
            goto fail;
        p->num_evictions++;
    }
    for (Py_ssize_t j = 0; j < from_free; j++)
        PyList_SET_ITEM(out, j, Py_NewRef(block_id(p, p->free_stack[--p->nfree])));
    for (Py_ssize_t j = 0; j < n; j++)
        p->refcount[PyLong_AsSsize_t(PyList_GET_ITEM(out, j))] = 1;
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* release(blocks, reverse) -> None, or the first block whose refcount was already 0 (those
 * before it were released; the caller raises). A block that reaches 0 goes to the free stack
 * when it has no key, else to the policy unless pinned. */
PyObject *pkv_pool_release(Pool *p, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "release(blocks, reverse)");
        return NULL;
    }
    int reverse = PyObject_IsTrue(args[1]);
    if (reverse < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "release() takes a sequence of blocks");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq), *result = NULL;
    for (Py_ssize_t j = 0; j < count; j++) {
        PyObject *item = items[reverse ? count - 1 - j : j];
        Py_ssize_t b = pkv_pool_block(p, item);
        if (b < 0)
            goto done;
        int32_t rc = p->refcount[b] - 1;
        if (rc) {
            if (rc < 0) {
                result = Py_NewRef(item);
                goto done;
            }
            p->refcount[b] = rc;
            continue;
        }
        p->refcount[b] = 0;
        if (PyList_GET_ITEM(p->key_of, b) == Py_None) {
            if (policy_forget(p, b) < 0)
                goto done;
            p->free_stack[p->nfree++] = (int32_t)b;
        } else if (p->pins[b] == 0 && policy_add(p, b) < 0) {
            goto done;
        }
    }
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(seq);
    return result;
}

static int incref(Pool *p, Py_ssize_t b)
{
    if (p->refcount[b] == 0) {
        int listed = policy_has(p, b);
        if (listed < 0 || (listed && policy_remove(p, b) < 0))
            return -1;
    }
    p->refcount[b]++;
    return 0;
}

PyObject *pkv_pool_incref(Pool *p, PyObject *arg)
{
    Py_ssize_t b = pkv_pool_block(p, arg);
    if (b < 0 || incref(p, b) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* acquire(blocks): a prefix hit on cached blocks: a reference each (an evictable one is
 * revived), and a use for the policy, block by block. */
PyObject *pkv_pool_acquire(Pool *p, PyObject *blocks)
{
    PyObject *seq = PySequence_Fast(blocks, "acquire() takes a sequence of blocks");
    if (seq == NULL)
        return NULL;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(seq); j++) {
        Py_ssize_t b = pkv_pool_block(p, items[j]);
        if (b < 0 || incref(p, b) < 0 || policy_touch(p, b) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* ---- keys ---- */

/* 1 when b takes key, 0 when refused (b has a key, or another block holds this one), -1 on error. */
static int publish(Pool *p, Py_ssize_t b, PyObject *key)
{
    if (PyList_GET_ITEM(p->key_of, b) != Py_None)
        return 0;
    int held = PyDict_Contains(p->block_of_key, key);
    if (held != 0)
        return held < 0 ? -1 : 0;
    if (PyDict_SetItem(p->block_of_key, key, block_id(p, b)) < 0)
        return -1;
    PyList_SetItem(p->key_of, b, Py_NewRef(key));
    return 1;
}

PyObject *pkv_pool_publish(Pool *p, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "publish(block, key)");
        return NULL;
    }
    Py_ssize_t b = pkv_pool_block(p, args[0]);
    int r = b < 0 ? -1 : publish(p, b, args[1]);
    return r < 0 ? NULL : PyBool_FromLong(r);
}

/* publish_many(blocks, keys) -> the keys that were published, in order (refused ones left out). */
PyObject *pkv_pool_publish_many(Pool *p, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "publish_many(blocks, keys)");
        return NULL;
    }
    PyObject *blocks = PySequence_Fast(args[0], "blocks must be a sequence"), *out = NULL;
    PyObject *keys = blocks ? PySequence_Fast(args[1], "keys must be a sequence") : NULL;
    if (keys == NULL)
        goto done;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(blocks);
    if (PySequence_Fast_GET_SIZE(keys) != count) {
        PyErr_SetString(PyExc_ValueError, "publish_many: one key per block");
        goto done;
    }
    if ((out = PyList_New(0)) == NULL)
        goto done;
    for (Py_ssize_t j = 0; j < count; j++) {
        PyObject *key = PySequence_Fast_GET_ITEM(keys, j);
        Py_ssize_t b = pkv_pool_block(p, PySequence_Fast_GET_ITEM(blocks, j));
        int r = b < 0 ? -1 : publish(p, b, key);
        if (r < 0 || (r == 1 && PyList_Append(out, key) < 0)) {
            Py_CLEAR(out);
            goto done;
        }
    }
done:
    Py_XDECREF(blocks);
    Py_XDECREF(keys);
    return out;
}

/* drop(block) -> its key or None: an unreferenced, unpinned block (the caller checked) loses
 * its key and becomes free. */
PyObject *pkv_pool_drop(Pool *p, PyObject *arg)
{
    Py_ssize_t b = pkv_pool_block(p, arg);
    if (b < 0)
        return NULL;
    PyObject *key = PyList_GET_ITEM(p->key_of, b);
    if (key == Py_None)
        Py_RETURN_NONE;
    Py_INCREF(key);
    int listed = policy_has(p, b);
    if (listed < 0 || (listed && policy_remove(p, b) < 0) || PyDict_DelItem(p->block_of_key, key) < 0)
        goto fail;
    PyList_SetItem(p->key_of, b, Py_NewRef(Py_None));
    if (policy_forget(p, b) < 0)
        goto fail;
    p->free_stack[p->nfree++] = (int32_t)b;
    return key;
fail:
    Py_DECREF(key);
    return NULL;
}

/* lookup(key) -> block or None. */
PyObject *pkv_pool_lookup(Pool *p, PyObject *key)
{
    PyObject *b = PyDict_GetItemWithError(p->block_of_key, key);
    if (b == NULL && PyErr_Occurred())
        return NULL;
    return Py_NewRef(b ? b : Py_None);
}

/* match(keys) -> the blocks of the longest prefix of keys this pool holds. Changes nothing. */
PyObject *pkv_pool_match(Pool *p, PyObject *keys)
{
    PyObject *seq = PySequence_Fast(keys, "match() takes a sequence of keys");
    if (seq == NULL)
        return NULL;
    PyObject *out = PyList_New(0);
    for (Py_ssize_t j = 0; out != NULL && j < PySequence_Fast_GET_SIZE(seq); j++) {
        PyObject *b = PyDict_GetItemWithError(p->block_of_key, PySequence_Fast_GET_ITEM(seq, j));
        if (b == NULL) {
            if (PyErr_Occurred())
                Py_CLEAR(out);
            break;
        }
        if (PyList_Append(out, b) < 0)
            Py_CLEAR(out);
    }
    Py_DECREF(seq);
    return out;
}

/* ---- pins ---- */

/* pin(block) -> False (changing nothing) when the block has no key. */
PyObject *pkv_pool_pin(Pool *p, PyObject *arg)
{
    Py_ssize_t b = pkv_pool_block(p, arg);
    if (b < 0)
        return NULL;
    if (PyList_GET_ITEM(p->key_of, b) == Py_None)
        Py_RETURN_FALSE;
    if (p->pins[b] == 0) {
        int listed = policy_has(p, b);
        if (listed < 0 || (listed && policy_remove(p, b) < 0))
            return NULL;
    }
    p->pins[b]++;
    Py_RETURN_TRUE;
}

/* unpin(block) -> False (changing nothing) when the block is not pinned. */
PyObject *pkv_pool_unpin(Pool *p, PyObject *arg)
{
    Py_ssize_t b = pkv_pool_block(p, arg);
    if (b < 0)
        return NULL;
    if (p->pins[b] == 0)
        Py_RETURN_FALSE;
    if (--p->pins[b] == 0 && p->refcount[b] == 0 && policy_add(p, b) < 0)
        return NULL;
    Py_RETURN_TRUE;
}
