/* A compiled decode group (cache_node/kv/decode.py's DecodeGroup, same attributes and steps).
 *
 * The group owns what a step touches: the members' ids, their token lists and their tables,
 * keys and scores lists (references to the Sequence objects' own lists, taken when the group
 * formed; any change to a member that replaces a list drops the group first), the schedule
 * by_fill[r] (members whose length was r mod block_size when the group formed) and the step
 * count. A step appends each member's token, counts the step, and gives the members that open
 * a block this step their block straight off the compiled Pool's free stack; what is left (a
 * block that must evict, a block that became full and must be keyed) goes back to Python.
 */
#include "pool.h"

typedef struct {
    PyObject_HEAD
    PyObject *ids;         /* tuple */
    PyObject *members;     /* frozenset(ids) */
    PyObject *batch;       /* list: the member sequences (opaque here) */
    PyObject *token_lists; /* list of the members' token lists */
    PyObject *tables, *keys, *scores; /* lists of the members' lists */
    PyObject *by_fill;     /* list of block_size lists of member indices */
    Py_ssize_t n, bs, num_steps;
    int keep_ids; /* prefix caching: token ids are appended and full blocks keyed */
} Group;

static PyObject *nothing_left; /* ((), ()): a step with nothing left for Python */
static PyObject *zero_float;

static int same_sized_lists(PyObject *lists, Py_ssize_t n, const char *what)
{
    if (!PyList_CheckExact(lists) || PyList_GET_SIZE(lists) != n) {
        PyErr_Format(PyExc_TypeError, "DecodeGroup: %s must be a list of one list per member", what);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyList_CheckExact(PyList_GET_ITEM(lists, i))) {
            PyErr_Format(PyExc_TypeError, "DecodeGroup: %s must hold lists", what);
            return -1;
        }
    return 0;
}

static PyObject *group_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"ids", "batch", "token_lists", "tables", "keys", "scores", "by_fill", "keep_ids", NULL};
    PyObject *ids, *batch, *token_lists, *tables, *keys, *scores, *by_fill;
    int keep_ids;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!OOOOO!p:DecodeGroup", kwlist, &PyTuple_Type, &ids, &PyList_Type,
                                     &batch, &token_lists, &tables, &keys, &scores, &PyList_Type, &by_fill, &keep_ids))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(ids), bs = PyList_GET_SIZE(by_fill);
    if (PyList_GET_SIZE(batch) != n || bs == 0 || same_sized_lists(token_lists, n, "token_lists") < 0 ||
        same_sized_lists(tables, n, "tables") < 0 || same_sized_lists(keys, n, "keys") < 0 ||
        same_sized_lists(scores, n, "scores") < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "DecodeGroup: one sequence per id and a non-empty schedule");
        return NULL;
    }
    for (Py_ssize_t r = 0; r < bs; r++) { /* every scheduled index names a member */
        PyObject *fill = PyList_GET_ITEM(by_fill, r);
        if (!PyList_CheckExact(fill)) {
            PyErr_SetString(PyExc_TypeError, "DecodeGroup: by_fill must hold lists");
            return NULL;
        }
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(fill); j++) {
            Py_ssize_t i = PyLong_AsSsize_t(PyList_GET_ITEM(fill, j));
            if (i < 0 || i >= n) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_ValueError, "DecodeGroup: a scheduled index outside the batch");
                return NULL;
            }
        }
    }
    Group *g = (Group *)type->tp_alloc(type, 0);
    if (g == NULL)
        return NULL;
    g->ids = Py_NewRef(ids);
    g->batch = Py_NewRef(batch);
    g->token_lists = Py_NewRef(token_lists);
    g->tables = Py_NewRef(tables);
    g->keys = Py_NewRef(keys);
    g->scores = Py_NewRef(scores);
    g->by_fill = Py_NewRef(by_fill);
    g->n = n;
    g->bs = bs;
    g->keep_ids = keep_ids;
    if ((g->members = PyFrozenSet_New(ids)) == NULL) {
        Py_DECREF(g);
        return NULL;
    }
    return (PyObject *)g;
}

/* Member i opens the block on top of pool's free stack (the caller checked there is one). */
static int open_from_free(Group *g, Pool *pool, Py_ssize_t i)
{
    if (i < 0 || i >= g->n) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_IndexError, "DecodeGroup: a scheduled index outside the batch");
        return -1;
    }
    int32_t b = pool->free_stack[pool->nfree - 1];
    PyObject *block = PyTuple_GET_ITEM(pool->ids, b);
    if (PyList_Append(PyList_GET_ITEM(g->tables, i), block) < 0 ||
        PyList_Append(PyList_GET_ITEM(g->keys, i), Py_None) < 0 ||
        PyList_Append(PyList_GET_ITEM(g->scores, i), zero_float) < 0)
        return -1;
    pool->nfree--;
    pool->refcount[b] = 1;
    return 0;
}

/* Step num_steps + 1 with token i for member i (tokens already checked): returns (opened,
 * filled), the members Python still has to open a block for (every opener, in batch order,
 * when the free stack is short or a member also fills its block this step) and those whose
 * block became full; or NULL with an exception (nothing changed unless a list append failed). */
static PyObject *advance(Group *g, PyObject **tokens, Pool *pool)
{
    for (Py_ssize_t i = 0; g->keep_ids && i < g->n; i++)
        if (PyList_Append(PyList_GET_ITEM(g->token_lists, i), tokens[i]) < 0)
            return NULL;
    Py_ssize_t t = ++g->num_steps;
    PyObject *opened = PyList_GET_ITEM(g->by_fill, ((1 - t) % g->bs + g->bs) % g->bs);
    PyObject *filled = g->keep_ids ? PyList_GET_ITEM(g->by_fill, ((-t) % g->bs + g->bs) % g->bs) : NULL;
    Py_ssize_t nopen = PyList_GET_SIZE(opened), nfill = filled ? PyList_GET_SIZE(filled) : 0;
    if (nopen && !nfill && pool != NULL && nopen <= pool->nfree) { /* no eviction, nothing to key */
        for (Py_ssize_t j = 0; j < nopen; j++)
            if (open_from_free(g, pool, PyLong_AsSsize_t(PyList_GET_ITEM(opened, j))) < 0)
                return NULL;
        nopen = 0;
    }
    if (!nopen && !nfill)
        return Py_NewRef(nothing_left);
    PyObject *none_left = PyTuple_GET_ITEM(nothing_left, 0);
    return PyTuple_Pack(2, nopen ? opened : none_left, nfill ? filled : none_left);
}

static Pool *pool_arg(PyObject *pool)
{
    if (pool == Py_None)
        return NULL;
    if (!PyObject_TypeCheck(pool, &pkv_PoolType)) {
        PyErr_SetString(PyExc_TypeError, "DecodeGroup: pool must be a compiled Pool or None");
        return (Pool *)-1;
    }
    return (Pool *)pool;
}

/* step(token_ids, pool) -> (opened, filled): the step for tokens of a batch already checked. */
static PyObject *group_step(Group *g, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "step(token_ids, pool)");
        return NULL;
    }
    Pool *pool = pool_arg(args[1]);
    if (pool == (Pool *)-1)
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "step: token_ids must be a sequence");
    if (seq == NULL)
        return NULL;
    PyObject *result = NULL;
    if (PySequence_Fast_GET_SIZE(seq) != g->n)
        PyErr_SetString(PyExc_ValueError, "step: one token per member");
    else
        result = advance(g, PySequence_Fast_ITEMS(seq), pool);
    Py_DECREF(seq);
    return result;
}

/* step_pairs(pairs, pool) -> (opened, filled), or None (nothing changed) unless pairs is a list
 * or tuple of (id, token) 2-tuples or 2-lists naming exactly the members, in order, and the
 * pool holds a block for each member. */
static PyObject *group_step_pairs(Group *g, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "step_pairs(pairs, pool)");
        return NULL;
    }
    PyObject *pairs = args[0];
    Pool *pool = pool_arg(args[1]);
    if (pool == (Pool *)-1)
        return NULL;
    if (!(PyList_CheckExact(pairs) || PyTuple_CheckExact(pairs)) || PySequence_Fast_GET_SIZE(pairs) != g->n)
        Py_RETURN_NONE;
    if (pool != NULL) {
        Py_ssize_t evictable = pool->nfree >= g->n ? 0 : pkv_pool_evictable(pool);
        if (evictable < 0)
            return NULL;
        if (g->n > pool->nfree + evictable)
            Py_RETURN_NONE;
    }
    for (Py_ssize_t i = 0; i < g->n; i++) { /* every pair checked before anything changes */
        if (PySequence_Fast_GET_SIZE(pairs) != g->n) /* an id's __eq__ changed the pairs */
            Py_RETURN_NONE;
        PyObject *pair = PySequence_Fast_ITEMS(pairs)[i], *id;
        if (PyTuple_CheckExact(pair) && PyTuple_GET_SIZE(pair) == 2)
            id = PyTuple_GET_ITEM(pair, 0);
        else if (PyList_CheckExact(pair) && PyList_GET_SIZE(pair) == 2)
            id = PyList_GET_ITEM(pair, 0);
        else
            Py_RETURN_NONE;
        PyObject *want = PyTuple_GET_ITEM(g->ids, i);
        if (id != want) {
            Py_INCREF(pair); /* the comparison may run Python code */
            int same = PyObject_RichCompareBool(id, want, Py_EQ);
            Py_DECREF(pair);
            if (same <= 0)
                return same < 0 ? NULL : Py_NewRef(Py_None);
        }
    }
    if (PySequence_Fast_GET_SIZE(pairs) != g->n)
        Py_RETURN_NONE;
    PyObject **items = PySequence_Fast_ITEMS(pairs);
    PyObject **tokens = PyMem_Malloc((g->n ? g->n : 1) * sizeof(PyObject *));
    if (tokens == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < g->n; i++) { /* no Python code runs from here on: the pairs stay as checked */
        PyObject *pair = items[i];
        if (PyTuple_CheckExact(pair) && PyTuple_GET_SIZE(pair) == 2)
            tokens[i] = PyTuple_GET_ITEM(pair, 1);
        else if (PyList_CheckExact(pair) && PyList_GET_SIZE(pair) == 2)
            tokens[i] = PyList_GET_ITEM(pair, 1);
        else { /* a pair changed meanwhile */
            PyMem_Free(tokens);
            Py_RETURN_NONE;
        }
    }
    PyObject *result = advance(g, tokens, pool);
    PyMem_Free(tokens);
    return result;
}

static int group_traverse(Group *g, visitproc visit, void *arg)
{
    Py_VISIT(g->ids);
    Py_VISIT(g->members);
    Py_VISIT(g->batch);
    Py_VISIT(g->token_lists);
    Py_VISIT(g->tables);
    Py_VISIT(g->keys);
    Py_VISIT(g->scores);
    Py_VISIT(g->by_fill);
    return 0;
}

static int group_clear(Group *g)
{
    Py_CLEAR(g->ids);
    Py_CLEAR(g->members);
    Py_CLEAR(g->batch);
    Py_CLEAR(g->token_lists);
    Py_CLEAR(g->tables);
    Py_CLEAR(g->keys);
    Py_CLEAR(g->scores);
    Py_CLEAR(g->by_fill);
    return 0;
}

static void group_dealloc(Group *g)
{
    PyObject_GC_UnTrack(g);
    group_clear(g);
    Py_TYPE(g)->tp_free((PyObject *)g);
}

static PyObject *get_num_steps(Group *g, void *c) { return PyLong_FromSsize_t(g->num_steps); }

static int set_num_steps(Group *g, PyObject *value, void *c)
{
    Py_ssize_t t = value ? PyLong_AsSsize_t(value) : -1;
    if (t < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "num_steps must be an int >= 0");
        return -1;
    }
    g->num_steps = t;
    return 0;
}

#define FIELD(name) \
    static PyObject *get_##name(Group *g, void *c) { return Py_NewRef(g->name); }
FIELD(ids)
FIELD(members)
FIELD(batch)
FIELD(token_lists)
FIELD(by_fill)

static PyGetSetDef group_getset[] = {
    {"ids", (getter)get_ids, NULL, "The members' ids, in batch order.", NULL},
    {"members", (getter)get_members, NULL, "frozenset(ids).", NULL},
    {"batch", (getter)get_batch, NULL, "The member sequences.", NULL},
    {"token_lists", (getter)get_token_lists, NULL, "The members' token lists.", NULL},
    {"by_fill", (getter)get_by_fill, NULL, "by_fill[r]: members whose length was r mod block_size.", NULL},
    {"num_steps", (getter)get_num_steps, (setter)set_num_steps, "Steps taken since the group formed.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef group_methods[] = {
    {"step", (PyCFunction)(void (*)(void))group_step, METH_FASTCALL, "step(token_ids, pool) -> (opened, filled)."},
    {"step_pairs", (PyCFunction)(void (*)(void))group_step_pairs, METH_FASTCALL,
     "step_pairs(pairs, pool) -> (opened, filled), or None when the pairs do not fit the group."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject pkv_DecodeGroupType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_block_core.DecodeGroup",
    .tp_basicsize = sizeof(Group),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "DecodeGroup(ids, batch, token_lists, tables, keys, scores, by_fill, keep_ids); see decode_group.c.",
    .tp_new = group_new,
    .tp_dealloc = (destructor)group_dealloc,
    .tp_traverse = (traverseproc)group_traverse,
    .tp_clear = (inquiry)group_clear,
    .tp_methods = group_methods,
    .tp_getset = group_getset,
};

int pkv_decode_group_ready(void)
{
    PyObject *empty = PyTuple_New(0);
    zero_float = PyFloat_FromDouble(0.0);
    nothing_left = empty ? PyTuple_Pack(2, empty, empty) : NULL;
    Py_XDECREF(empty);
    return nothing_left && zero_float ? PyType_Ready(&pkv_DecodeGroupType) : -1;
}
