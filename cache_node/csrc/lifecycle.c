/* A sequence's open, reserve and free for a manager without prefix caching (kv/compiled.py's
 * CompiledKVCacheManager: this type is its base, so these are the class's methods).
 *
 * Without prefix caching a sequence's lifecycle is a handful of list operations around the
 * pool's take and release; a Python frame per call costs more than the work. The usual case
 * runs here: a new sequence with the default salt, a reserve on a simple active sequence
 * outside the decode group, a free without keep_prefix. Every other case, and every case
 * that would raise, calls the Python method (KVCacheManager's, given to bind()), which is the
 * reference these are tested against step by step (tests/unit/test_block_core_lifecycle.py).
 * Sequence objects are built and read through their slots' descriptors (the public
 * descriptor protocol), in the field order bind() was given.
 */
#include "pool.h"

enum { SEQ_ID, ROOT, TOKENS, TABLE, KEYS, SCORES, NUM_DROPPED, HOST_TABLE, BUDGET, CHAIN_INTACT, HINT, SIMPLE,
       NUM_ELIDED, DECODE_GROUP, NUM_FIELDS };
#define NUM_DEFAULTS (NUM_FIELDS - NUM_DROPPED) /* the fields a new sequence gets by default */

typedef struct {
    PyObject_HEAD
    PyObject *seqs;     /* dict: seq_id -> Sequence (the manager's own) */
    PyObject *device;   /* the device BlockPool: raise_if_overfreed() */
    Pool *pool;         /* its compiled core */
    PyObject *counters; /* Counters */
    PyObject *tiers;    /* Tiers: offload() what an allocation evicted */
    PyObject *root;     /* the key root of the empty salt */
    PyObject *seq_type; /* the Sequence class */
    PyObject *fields;   /* tuple: the slot descriptor of each field, in field order */
    PyObject *defaults; /* tuple: a new sequence's fields from num_dropped_tokens on */
    PyObject *no_hit;   /* open()'s result without a hit */
    PyObject *py_open, *py_reserve, *py_free; /* the reference methods */
    PyObject *decoder;  /* the manager's Decoder: its group */
    PyObject *evicted;  /* a list take() appends evicted keys to, emptied after each use */
    Py_ssize_t bs;
} Lifecycle;

static PyObject *s_group, *s_members, *s_drop_group, *s_offload, *s_prefix_query_tokens,
    *s_raise_if_overfreed, *zero_float;

static PyObject *field(Lifecycle *lc, PyObject *seq, int i) /* a new reference, or NULL */
{
    PyObject *d = PyTuple_GET_ITEM(lc->fields, i);
    return Py_TYPE(d)->tp_descr_get(d, seq, lc->seq_type);
}

static int set_field(Lifecycle *lc, PyObject *seq, int i, PyObject *value)
{
    PyObject *d = PyTuple_GET_ITEM(lc->fields, i);
    return Py_TYPE(d)->tp_descr_set(d, seq, value);
}

static PyObject *reference(PyObject *method, PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames)
{
    Py_ssize_t total = nargs + (kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0);
    PyObject *small[8], **stack = total < 8 ? small : PyMem_New(PyObject *, total + 1);
    if (stack == NULL)
        return PyErr_NoMemory();
    stack[0] = self;
    for (Py_ssize_t i = 0; i < total; i++)
        stack[i + 1] = args[i];
    PyObject *out = PyObject_Vectorcall(method, stack, (size_t)(nargs + 1), kwnames);
    if (stack != small)
        PyMem_Free(stack);
    return out;
}

/* Whether seq_id is a member of the manager's decode group (seq_id NULL: whether there is a
 * group): 1, 0, or -1 with an error. */
static int in_group(Lifecycle *lc, PyObject *seq_id)
{
    PyObject *group = PyObject_GetAttr(lc->decoder, s_group);
    if (group == NULL)
        return -1;
    int member = group != Py_None;
    if (member && seq_id != NULL) {
        PyObject *members = PyObject_GetAttr(group, s_members);
        member = members == NULL ? -1 : PySequence_Contains(members, seq_id);
        Py_XDECREF(members);
    }
    Py_DECREF(group);
    return member;
}

static PyObject *lc_open(Lifecycle *lc, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *self = (PyObject *)lc;
    if (nargs != 2 || kwnames != NULL || lc->seqs == NULL)
        return reference(lc->py_open, self, args, nargs, kwnames);
    int exists = PyDict_Contains(lc->seqs, args[0]);
    Py_ssize_t n = exists ? -1 : PyObject_Size(args[1]);
    if (n < 0) { /* exists, unhashable or unsized: the reference raises */
        PyErr_Clear();
        return reference(lc->py_open, self, args, nargs, kwnames);
    }
    PyObject *count = PyObject_GetAttr(lc->counters, s_prefix_query_tokens), *sum = NULL, *len = NULL;
    if (count != NULL && (len = PyLong_FromSsize_t(n)) != NULL)
        sum = PyNumber_Add(count, len);
    Py_XDECREF(count);
    Py_XDECREF(len);
    if (sum == NULL || PyObject_SetAttr(lc->counters, s_prefix_query_tokens, sum) < 0) {
        Py_XDECREF(sum);
        return NULL;
    }
    Py_DECREF(sum);
    PyTypeObject *type = (PyTypeObject *)lc->seq_type;
    PyObject *seq = type->tp_alloc(type, 0);
    if (seq == NULL)
        return NULL;
    int bad = set_field(lc, seq, SEQ_ID, args[0]) < 0 || set_field(lc, seq, ROOT, lc->root) < 0;
    for (int i = TOKENS; i <= SCORES && !bad; i++) {
        PyObject *list = PyList_New(0);
        bad = list == NULL || set_field(lc, seq, i, list) < 0;
        Py_XDECREF(list);
    }
    for (int i = NUM_DROPPED; i < NUM_FIELDS && !bad; i++)
        bad = set_field(lc, seq, i, PyTuple_GET_ITEM(lc->defaults, i - NUM_DROPPED)) < 0;
    bad = bad || PyDict_SetItem(lc->seqs, args[0], seq) < 0;
    Py_DECREF(seq);
    return bad ? NULL : Py_NewRef(lc->no_hit);
}

static Py_ssize_t size_field(Lifecycle *lc, PyObject *seq, int i, int is_list)
{
    PyObject *v = field(lc, seq, i);
    if (v == NULL)
        return -1;
    Py_ssize_t out = is_list ? PyList_GET_SIZE(v) : PyLong_AsSsize_t(v);
    Py_DECREF(v);
    return out;
}

/* list += [item] * k, from runs of None and 0.0 kept for the usual counts (never mutated). */
#define NUM_RUNS 64
static PyObject *none_runs[NUM_RUNS], *zero_runs[NUM_RUNS];

static int append_n(PyObject *list, PyObject *item, PyObject **runs, Py_ssize_t k)
{
    PyObject *run = k < NUM_RUNS ? runs[k] : NULL;
    if (run == NULL) {
        if ((run = PyList_New(k)) == NULL)
            return -1;
        for (Py_ssize_t i = 0; i < k; i++)
            PyList_SET_ITEM(run, i, Py_NewRef(item));
        if (k < NUM_RUNS)
            runs[k] = Py_NewRef(run);
    } else
        Py_INCREF(run);
    int rc = PyList_SetSlice(list, PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, run);
    Py_DECREF(run);
    return rc;
}

/* The usual reserve: a simple active sequence outside the decode group. 1 when done, 0 when
 * the reference must take it (nothing changed), -1 on an error. */
static int reserve_simple(Lifecycle *lc, PyObject *seq, PyObject *seq_id, Py_ssize_t n, Py_ssize_t *start)
{
    for (int i = HOST_TABLE; i <= DECODE_GROUP; i++) {
        if (i != HOST_TABLE && i != BUDGET && i != SIMPLE && i != DECODE_GROUP)
            continue;
        PyObject *v = field(lc, seq, i);
        if (v == NULL)
            return -1;
        int usual = i == SIMPLE ? v == Py_True : v == Py_None;
        Py_DECREF(v);
        if (!usual)
            return 0;
    }
    int member = in_group(lc, seq_id);
    if (member != 0)
        return member < 0 ? -1 : 0;
    PyObject *table = field(lc, seq, TABLE);
    if (table == NULL)
        return -1;
    Py_ssize_t tokens = size_field(lc, seq, TOKENS, 1), elided = size_field(lc, seq, NUM_ELIDED, 0),
               dropped = size_field(lc, seq, NUM_DROPPED, 0);
    int rc = -1;
    PyObject *evicted = NULL, *blocks = NULL, *need_obj = NULL, *count = NULL;
    if ((tokens < 0 || elided < 0 || dropped < 0) && PyErr_Occurred())
        goto done;
    *start = tokens + elided - dropped;
    Py_ssize_t need = (*start + n + lc->bs - 1) / lc->bs - PyList_GET_SIZE(table);
    if (need > 0) {
        evicted = Py_NewRef(lc->evicted);
        if ((need_obj = PyLong_FromSsize_t(need)) == NULL)
            goto done;
        PyObject *take_args[2] = {need_obj, evicted};
        if ((blocks = pkv_pool_take(lc->pool, take_args, 2)) == NULL)
            goto done;
        if (blocks == Py_None) { /* too little room: the reference raises, nothing taken */
            rc = 0;
            goto done;
        }
        Py_ssize_t k = PyList_GET_SIZE(evicted), m = PyList_GET_SIZE(blocks);
        if (k) { /* what the allocation evicted goes to the host tier or out, as Tiers.allocate */
            PyObject *victims = PyList_GetSlice(blocks, m - k, m);
            PyObject *keys = PyList_GetSlice(evicted, 0, k);
            PyObject *r = victims == NULL || keys == NULL || PyList_SetSlice(evicted, 0, k, NULL) < 0
                              ? NULL
                              : PyObject_CallMethodObjArgs(lc->tiers, s_offload, victims, keys, NULL);
            Py_XDECREF(victims);
            Py_XDECREF(keys);
            if (r == NULL)
                goto done;
            Py_DECREF(r);
        }
        PyObject *keys = field(lc, seq, KEYS), *scores = keys == NULL ? NULL : field(lc, seq, SCORES);
        int bad = scores == NULL || PyList_SetSlice(table, PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, blocks) < 0 ||
                  append_n(keys, Py_None, none_runs, need) < 0 ||
                  append_n(scores, zero_float, zero_runs, need) < 0;
        Py_XDECREF(keys);
        Py_XDECREF(scores);
        if (bad)
            goto done;
    }
    if ((count = PyLong_FromSsize_t(elided + n)) == NULL || set_field(lc, seq, NUM_ELIDED, count) < 0)
        goto done;
    rc = 1;
done:
    if (evicted != NULL && PyList_GET_SIZE(evicted) && PyList_SetSlice(evicted, 0, PY_SSIZE_T_MAX, NULL) < 0)
        rc = -1; /* a take that failed part way: the scratch list starts empty next time */
    Py_DECREF(table);
    Py_XDECREF(evicted);
    Py_XDECREF(blocks);
    Py_XDECREF(need_obj);
    Py_XDECREF(count);
    return rc;
}

static PyObject *lc_reserve(Lifecycle *lc, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (nargs == 2 && kwnames == NULL && lc->seqs != NULL) {
        PyObject *seq = PyDict_GetItemWithError(lc->seqs, args[0]);
        if (seq == NULL)
            PyErr_Clear(); /* unhashable: the reference raises */
        Py_ssize_t n = seq == NULL || Py_TYPE(seq) != (PyTypeObject *)lc->seq_type ? 0 : PyObject_Size(args[1]);
        if (n < 0)
            PyErr_Clear(); /* unsized: the reference raises */
        if (n > 0) {
            Py_ssize_t start = 0;
            Py_INCREF(seq);
            int done = reserve_simple(lc, seq, args[0], n, &start);
            Py_DECREF(seq);
            if (done < 0)
                return NULL;
            if (done)
                return PyLong_FromSsize_t(start);
        }
    }
    return reference(lc->py_reserve, (PyObject *)lc, args, nargs, kwnames);
}

static PyObject *lc_free(Lifecycle *lc, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *self = (PyObject *)lc;
    PyObject *seq = NULL;
    if (nargs == 1 && kwnames == NULL && lc->seqs != NULL) {
        seq = PyDict_GetItemWithError(lc->seqs, args[0]);
        if (seq == NULL)
            PyErr_Clear(); /* unhashable: the reference decides (dict.pop of an empty dict does not hash) */
    }
    if (seq == NULL || Py_TYPE(seq) != (PyTypeObject *)lc->seq_type)
        return reference(lc->py_free, self, args, nargs, kwnames);
    PyObject *host = field(lc, seq, HOST_TABLE);
    if (host == NULL)
        return NULL;
    Py_DECREF(host);
    if (host != Py_None) /* swapped out: its blocks are the host's */
        return reference(lc->py_free, self, args, nargs, kwnames);
    Py_INCREF(seq);
    PyObject *table = NULL, *bad = NULL, *out = NULL;
    if (PyDict_DelItem(lc->seqs, args[0]) < 0)
        goto done;
    int member = in_group(lc, NULL);
    if (member < 0)
        goto done;
    if (member) {
        PyObject *r = PyObject_CallMethodNoArgs(lc->decoder, s_drop_group);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
    }
    if ((table = field(lc, seq, TABLE)) == NULL)
        goto done;
    PyObject *release_args[2] = {table, Py_True};
    if ((bad = pkv_pool_release(lc->pool, release_args, 2)) == NULL)
        goto done;
    out = bad == Py_None ? Py_NewRef(Py_None) : PyObject_CallMethodOneArg(lc->device, s_raise_if_overfreed, bad);
done:
    Py_DECREF(seq);
    Py_XDECREF(table);
    Py_XDECREF(bad);
    return out;
}

/* bind(seqs, device, pool, counters, tiers, root, block_size, seq_type, fields, defaults, no_hit,
 *      py_open, py_reserve, py_free, decoder): once, at the end of the manager's __init__. */
static PyObject *lc_bind(Lifecycle *lc, PyObject *args)
{
    PyObject *seqs, *device, *pool, *counters, *tiers, *root, *seq_type, *fields, *defaults, *no_hit, *po, *pr, *pf,
        *decoder;
    Py_ssize_t bs;
    if (!PyArg_ParseTuple(args, "O!OO!OOSnO!O!O!OOOOO:bind", &PyDict_Type, &seqs, &device, &pkv_PoolType, &pool,
                          &counters, &tiers, &root, &bs, &PyType_Type, &seq_type, &PyTuple_Type, &fields,
                          &PyTuple_Type, &defaults, &no_hit, &po, &pr, &pf, &decoder))
        return NULL;
    if (bs <= 0 || PyTuple_GET_SIZE(fields) != NUM_FIELDS || PyTuple_GET_SIZE(defaults) != NUM_DEFAULTS) {
        PyErr_SetString(PyExc_ValueError, "bind: a positive block size, a descriptor per field, the defaults");
        return NULL;
    }
    for (int i = 0; i < NUM_FIELDS; i++) {
        PyObject *d = PyTuple_GET_ITEM(fields, i);
        if (Py_TYPE(d)->tp_descr_get == NULL || Py_TYPE(d)->tp_descr_set == NULL) {
            PyErr_SetString(PyExc_TypeError, "bind: every field must be a data descriptor (a slot)");
            return NULL;
        }
    }
    PyObject *evicted = PyList_New(0);
    if (evicted == NULL)
        return NULL;
    PyObject *refs[] = {seqs, device, pool, counters, tiers, root, seq_type, fields, defaults, no_hit, po, pr, pf,
                        decoder, evicted};
    PyObject **slots[] = {&lc->seqs, &lc->device, (PyObject **)&lc->pool, &lc->counters, &lc->tiers, &lc->root,
                          &lc->seq_type, &lc->fields, &lc->defaults, &lc->no_hit, &lc->py_open, &lc->py_reserve,
                          &lc->py_free, &lc->decoder, &lc->evicted};
    for (size_t i = 0; i < sizeof(refs) / sizeof(refs[0]); i++)
        Py_XSETREF(*slots[i], Py_NewRef(refs[i]));
    Py_DECREF(evicted);
    lc->bs = bs;
    Py_RETURN_NONE;
}

static int lc_traverse(Lifecycle *lc, visitproc visit, void *arg)
{
    Py_VISIT(lc->seqs);
    Py_VISIT(lc->device);
    Py_VISIT(lc->pool);
    Py_VISIT(lc->counters);
    Py_VISIT(lc->tiers);
    Py_VISIT(lc->root);
    Py_VISIT(lc->seq_type);
    Py_VISIT(lc->fields);
    Py_VISIT(lc->defaults);
    Py_VISIT(lc->no_hit);
    Py_VISIT(lc->py_open);
    Py_VISIT(lc->py_reserve);
    Py_VISIT(lc->py_free);
    Py_VISIT(lc->decoder);
    Py_VISIT(lc->evicted);
    return 0;
}

static int lc_clear(Lifecycle *lc)
{
    Py_CLEAR(lc->seqs);
    Py_CLEAR(lc->device);
    Py_CLEAR(lc->pool);
    Py_CLEAR(lc->counters);
    Py_CLEAR(lc->tiers);
    Py_CLEAR(lc->root);
    Py_CLEAR(lc->seq_type);
    Py_CLEAR(lc->fields);
    Py_CLEAR(lc->defaults);
    Py_CLEAR(lc->no_hit);
    Py_CLEAR(lc->py_open);
    Py_CLEAR(lc->py_reserve);
    Py_CLEAR(lc->py_free);
    Py_CLEAR(lc->decoder);
    Py_CLEAR(lc->evicted);
    return 0;
}

static void lc_dealloc(Lifecycle *lc)
{
    PyObject_GC_UnTrack(lc);
    lc_clear(lc);
    Py_TYPE(lc)->tp_free((PyObject *)lc);
}

static PyMethodDef lc_methods[] = {
    {"open", (PyCFunction)(void (*)(void))lc_open, METH_FASTCALL | METH_KEYWORDS, "KVCacheManager.open"},
    {"reserve", (PyCFunction)(void (*)(void))lc_reserve, METH_FASTCALL | METH_KEYWORDS, "KVCacheManager.reserve"},
    {"free", (PyCFunction)(void (*)(void))lc_free, METH_FASTCALL | METH_KEYWORDS, "KVCacheManager.free"},
    {"bind", (PyCFunction)lc_bind, METH_VARARGS, "Give the manager's parts; see lifecycle.c."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject pkv_LifecycleType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_block_core.Lifecycle",
    .tp_basicsize = sizeof(Lifecycle),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A sequence's open, reserve and free without prefix caching; see csrc/lifecycle.c.",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)lc_dealloc,
    .tp_traverse = (traverseproc)lc_traverse,
    .tp_clear = (inquiry)lc_clear,
    .tp_methods = lc_methods,
};

int pkv_lifecycle_ready(void)
{
    const char *names[] = {"group", "members", "drop_group", "offload", "prefix_query_tokens",
                           "raise_if_overfreed"};
    PyObject **out[] = {&s_group, &s_members, &s_drop_group, &s_offload, &s_prefix_query_tokens,
                        &s_raise_if_overfreed};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (*out[i] == NULL && (*out[i] = PyUnicode_InternFromString(names[i])) == NULL)
            return -1;
    if (zero_float == NULL && (zero_float = PyFloat_FromDouble(0.0)) == NULL)
        return -1;
    return 0;
}
