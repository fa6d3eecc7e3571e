/* The Python face of every compiled eviction order (order.h): one base type whose methods
 * call the order's function table, so each implementation writes its C operations once. The
 * methods keep cache_node/eviction.py's policy contract: remove() of an absent block raises
 * KeyError, pop_victim() of an empty order IndexError; add() of a listed block changes nothing.
 */
#include "order.h"

Py_ssize_t pkv_block_arg(PyObject *arg)
{
    if (!PyLong_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "a block id must be an int, not %.100s", Py_TYPE(arg)->tp_name);
        return -1;
    }
    Py_ssize_t b = PyLong_AsSsize_t(arg);
    if (b == -1 && PyErr_Occurred())
        return -1;
    if (b < 0 || b >= PKV_MAX_BLOCKS) {
        PyErr_Format(PyExc_ValueError, "block id %zd outside [0, %zd)", b, PKV_MAX_BLOCKS);
        return -1;
    }
    return b;
}

int pkv_order_traverse(Order *o, visitproc visit, void *arg)
{
    Py_VISIT(o->key_of);
    return 0;
}

int pkv_order_clear(Order *o)
{
    Py_CLEAR(o->key_of);
    return 0;
}

static PyObject *order_add(Order *o, PyObject *arg)
{
    Py_ssize_t b = pkv_block_arg(arg);
    if (b < 0)
        return NULL;
    if (!o->ops->has(o, b) && o->ops->add(o, b) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *order_remove(Order *o, PyObject *arg)
{
    Py_ssize_t b = pkv_block_arg(arg);
    if (b < 0)
        return NULL;
    if (!o->ops->has(o, b)) {
        PyErr_SetObject(PyExc_KeyError, arg);
        return NULL;
    }
    o->ops->remove(o, b);
    Py_RETURN_NONE;
}

static PyObject *order_pop_victim(Order *o, PyObject *unused)
{
    if (o->count == 0) {
        PyErr_SetString(PyExc_IndexError, "no evictable block");
        return NULL;
    }
    Py_ssize_t b = o->ops->pop(o);
    return b < 0 ? NULL : PyLong_FromSsize_t(b);
}

static PyObject *order_touch(Order *o, PyObject *arg)
{
    Py_ssize_t b = pkv_block_arg(arg);
    if (b < 0 || o->ops->touch(o, b) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *order_forget(Order *o, PyObject *arg)
{
    Py_ssize_t b = pkv_block_arg(arg);
    if (b < 0)
        return NULL;
    o->ops->forget(o, b);
    Py_RETURN_NONE;
}

static PyObject *order_bind_keys(Order *o, PyObject *key_of)
{
    if (!PyList_CheckExact(key_of)) {
        PyErr_SetString(PyExc_TypeError, "bind_keys takes the pool's list of keys");
        return NULL;
    }
    Py_INCREF(key_of);
    Py_XSETREF(o->key_of, key_of);
    Py_RETURN_NONE;
}

static PyObject *order_victims(Order *o, PyObject *unused) { return o->ops->victims(o); }

static Py_ssize_t order_len(Order *o) { return o->count; }

static int order_contains(Order *o, PyObject *arg)
{
    if (!PyLong_Check(arg))
        return 0;
    Py_ssize_t b = PyLong_AsSsize_t(arg);
    if (b == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return b >= 0 && o->ops->has(o, b);
}

static PyObject *order_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyErr_SetString(PyExc_TypeError, "Order is abstract: use LRUOrder, SLRUOrder or HeapOrder");
    return NULL;
}

static PyMethodDef order_methods[] = {
    {"add", (PyCFunction)order_add, METH_O, "add(block): the block became evictable."},
    {"remove", (PyCFunction)order_remove, METH_O, "remove(block): it stops being evictable (KeyError if absent)."},
    {"pop_victim", (PyCFunction)order_pop_victim, METH_NOARGS,
     "pop_victim() -> block: removes and returns the next victim (IndexError when empty)."},
    {"touch", (PyCFunction)order_touch, METH_O, "touch(block): a use (a prefix hit)."},
    {"forget", (PyCFunction)order_forget, METH_O, "forget(block): its history ends."},
    {"bind_keys", (PyCFunction)order_bind_keys, METH_O, "bind_keys(key_of): the pool's block -> key list."},
    {"victims_in_order", (PyCFunction)order_victims, METH_NOARGS, "The listed blocks, next victim first."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods order_as_sequence = {
    .sq_length = (lenfunc)order_len,
    .sq_contains = (objobjproc)order_contains,
};

PyTypeObject pkv_OrderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_block_core.Order",
    .tp_basicsize = sizeof(Order),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A compiled eviction order (see order.h); the pool drives it without Python calls.",
    .tp_as_sequence = &order_as_sequence,
    .tp_methods = order_methods,
    .tp_new = order_new,
    .tp_traverse = (traverseproc)pkv_order_traverse,
    .tp_clear = (inquiry)pkv_order_clear,
};
