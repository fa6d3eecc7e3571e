/* The hot loops of the block pool and the decode-group step (cache_node/block_pool.py,
 * cache_node/kv_manager.py), as a CPython extension module `_block_core`.
 *
 * Every function works on the pool's own Python objects (the free list, the refcount
 * and key_of lists, the key dict, the LRU OrderedDict, the sequences' lists) and does
 * exactly what the Python loop it replaces does, in the same order; only the bytecode
 * dispatch is gone. The Python code keeps the checks (capacity, argument shapes) and is
 * the fallback when this module cannot be built: the state never lives here.
 *
 * Built at first use by cache_node/block_core.py (the system C compiler, the running
 * Python's headers), cached like the project's other native libraries.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#define ABI_VERSION 10

/* Attribute names the compiled loops read or write on sequences and decode groups, by id. */
enum {
    s_table_ID, s_keys_ID, s_scores_ID, s_tokens_ID, s_num_dropped_tokens_ID, s_simple_ID, s_root_ID, s_hint_ID,
    s_chain_intact_ID, s_num_elided_tokens_ID, s_decode_group_ID, s_ids_ID, s_token_lists_ID, s_batch_ID,
    s_by_fill_ID, s_num_steps_ID, s_host_table_ID, s_budget_ID, NUM_NAMES
};
static const char *const name_text[NUM_NAMES] = {
    "table", "keys", "scores", "tokens", "num_dropped_tokens", "simple", "root", "hint",
    "chain_intact", "num_elided_tokens", "decode_group", "ids", "token_lists", "batch",
    "by_fill", "num_steps", "host_table", "budget",
};
static PyObject *names[NUM_NAMES]; /* interned */
static PyObject *zero_float;       /* 0.0, the score of a new block */
static PyObject *one_long;
static PyObject *zero_long;

/* Attribute access by slot offset for the sequences and decode groups (classes with __slots__,
 * whose slot descriptors are never replaced): the hot paths read and write a handful of their
 * attributes per call, and each generic PyObject_GetAttr/SetAttr (a type-cache lookup and a
 * descriptor call) cost about as much as the rest of a decode step's fixed work. For each name
 * the last class seen and the member's offset in it are kept (one compare per access: the
 * sequences and the groups use distinct names), found by name in the class's own member table
 * when the class keeps object's generic getattr and setattr; anything else (no such member, an
 * unset slot) takes the generic path, with its errors. The cache holds a reference to each
 * class it names. */
static struct {
    PyTypeObject *type;
    Py_ssize_t offset; /* -1: not a slot of the class (generic access) */
} slot_cache[NUM_NAMES];

static Py_ssize_t slot_resolve(PyTypeObject *tp, int id)
{
    Py_ssize_t offset = -1;
    const char *want = name_text[id];
    int generic = tp->tp_getattro == PyObject_GenericGetAttr && tp->tp_setattro == PyObject_GenericSetAttr;
    for (PyMemberDef *m = generic ? tp->tp_members : NULL; m != NULL && m->name != NULL; m++)
        if (m->type == T_OBJECT_EX && strcmp(m->name, want) == 0)
            offset = m->offset;
    Py_INCREF(tp);
    Py_XSETREF(slot_cache[id].type, tp);
    slot_cache[id].offset = offset;
    return offset;
}

static inline Py_ssize_t slot_offset(PyObject *o, int id)
{
    PyTypeObject *tp = Py_TYPE(o);
    return slot_cache[id].type == tp ? slot_cache[id].offset : slot_resolve(tp, id);
}

/* getattr(o, name): a new reference, or NULL with the exception getattr raises. */
static inline PyObject *slot_get_id(PyObject *o, int id)
{
    Py_ssize_t offset = slot_offset(o, id);
    PyObject *v = offset >= 0 ? *(PyObject **)((char *)o + offset) : NULL;
    return v != NULL ? Py_NewRef(v) : PyObject_GetAttr(o, names[id]);
}

/* setattr(o, name, value): 0, or -1 with an exception set. */
static inline int slot_set_id(PyObject *o, int id, PyObject *value)
{
    Py_ssize_t offset = slot_offset(o, id);
    if (offset < 0)
        return PyObject_SetAttr(o, names[id], value);
    Py_XSETREF(*(PyObject **)((char *)o + offset), Py_NewRef(value));
    return 0;
}

#define slot_get(o, name) slot_get_id((o), name##_ID)
#define slot_set(o, name, value) slot_set_id((o), name##_ID, (value))

/* A Python int's value, with PyLong_AsSsize_t's result and errors; the common case (an exact
 * int below 2**30) read in place. */
static inline Py_ssize_t int_value(PyObject *v)
{
#if PY_VERSION_HEX < 0x030C0000
    if (PyLong_CheckExact(v)) {
        Py_ssize_t size = Py_SIZE(v);
        if (size == 0)
            return 0;
        if (size == 1)
            return (Py_ssize_t)((PyLongObject *)v)->ob_digit[0];
    }
#else
    if (PyLong_CheckExact(v) && PyUnstable_Long_IsCompact((PyLongObject *)v))
        return PyUnstable_Long_CompactValue((PyLongObject *)v);
#endif
    return PyLong_AsSsize_t(v);
}

#if defined(__GNUC__)
#define ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define ALWAYS_INLINE inline
#endif

/* list_index() for anything but an exact int in [0, len(list)): its errors, negative indexing. */
static Py_ssize_t list_index_slow(PyObject *list, PyObject *index)
{
    Py_ssize_t i = int_value(index);
    if (i == -1 && PyErr_Occurred())
        return -1;
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (i < 0)
        i += n;
    if (i < 0 || i >= n) {
        PyErr_SetString(PyExc_IndexError, "list index out of range");
        return -1;
    }
    return i;
}

/* list[i] for a Python int index, with Python's negative indexing; -1 + IndexError outside. A
 * block id (an exact int in range) is read in place. */
static ALWAYS_INLINE Py_ssize_t list_index(PyObject *list, PyObject *index)
{
#if PY_VERSION_HEX < 0x030C0000
    if (PyLong_CheckExact(index) && (size_t)Py_SIZE(index) <= 1) {
        Py_ssize_t i = Py_SIZE(index) ? (Py_ssize_t)((PyLongObject *)index)->ob_digit[0] : 0;
        if (i < PyList_GET_SIZE(list))
            return i;
    }
#endif
    return list_index_slow(list, index);
}

/* list[i] = value (a new reference to value is taken). */
static inline void list_store(PyObject *list, Py_ssize_t i, PyObject *value)
{
    PyObject *old = PyList_GET_ITEM(list, i);
    Py_INCREF(value);
    PyList_SET_ITEM(list, i, value);
    Py_DECREF(old);
}

/* Pop the last item of a non-empty list: a new reference (the list's reference, handed over;
 * the list keeps its allocation, as a later append would regrow it). */
static inline PyObject *list_pop(PyObject *list)
{
    Py_ssize_t n = PyList_GET_SIZE(list);
    PyObject *item = PyList_GET_ITEM(list, n - 1);
    Py_SET_SIZE(list, n - 1);
    return item;
}

/* Room for k more items at the end of a list, in one resize (with list.append's over-allocation):
 * returns where they go, for the caller to fill before any other use of the list (the size
 * already counts them), or NULL with MemoryError (the list unchanged). */
static PyObject **list_grow(PyObject *list, Py_ssize_t k)
{
    PyListObject *l = (PyListObject *)list;
    Py_ssize_t n = Py_SIZE(l), size = n + k;
    if (size > l->allocated) {
        size_t room = (size_t)size + ((size_t)size >> 3) + 6;
        room &= ~(size_t)3;
        if (room > (size_t)PY_SSIZE_T_MAX / sizeof(PyObject *)) {
            PyErr_NoMemory();
            return NULL;
        }
        PyObject **items = PyMem_Realloc(l->ob_item, room * sizeof(PyObject *));
        if (items == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        l->ob_item = items;
        l->allocated = (Py_ssize_t)room;
    }
    Py_SET_SIZE(l, size);
    return l->ob_item + n;
}

/* An evicted block's key leaves key_of and block_of_key: returns the key (a new reference),
 * or NULL with an exception set. */
static PyObject *forget_key(PyObject *block, PyObject *key_of, PyObject *block_of_key)
{
    Py_ssize_t i = list_index(key_of, block);
    if (i < 0)
        return NULL;
    PyObject *key = Py_NewRef(PyList_GET_ITEM(key_of, i));
    if (PyObject_DelItem(block_of_key, key) < 0) {
        Py_DECREF(key);
        return NULL;
    }
    list_store(key_of, i, Py_None);
    return key;
}

/* A METH_FASTCALL function's argument count (the hot paths skip PyArg_ParseTuple's format parsing). */
static int check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t want)
{
    if (nargs == want)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
    return -1;
}

static int check_list(PyObject *o, const char *what)
{
    if (!PyList_CheckExact(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list", what);
        return -1;
    }
    return 0;
}

/* ---- LRU: the LRU policy's order of evictable blocks -------------------------------------
 *
 * What LRUPolicy kept in an OrderedDict[int, None] (block -> None, oldest first), as a doubly
 * linked list over block ids held in arrays: membership, append, unlink and the oldest are a
 * few array reads, where an OrderedDict pays a hash lookup in the dict and another in its node
 * table for each. The Python side sees the OrderedDict operations the pool and the policy use
 * (len, in, iteration oldest first, lru[b] = None, del lru[b], popitem(last=False),
 * pop(b, default)), with the same results; the C functions below use the arrays directly. */
typedef struct {
    PyObject_HEAD
    Py_ssize_t cap;     /* size of the arrays */
    Py_ssize_t *prev;   /* prev[b], next[b]: neighbours in the order, -1 at the ends */
    Py_ssize_t *next;
    char *in;           /* in[b]: b is listed */
    Py_ssize_t head;    /* the oldest, or -1 */
    Py_ssize_t tail;    /* the youngest, or -1 */
    Py_ssize_t count;
    size_t version;     /* bumped on every change: iterators refuse to go on after one */
} LRUObject;

static PyTypeObject LRUType;
static PyTypeObject LRUIterType;

#define IS_LRU(o) (Py_TYPE(o) == &LRUType)

static int lru_grow(LRUObject *lru, Py_ssize_t need)
{
    if (need <= lru->cap)
        return 0;
    Py_ssize_t cap = lru->cap ? lru->cap : 64;
    while (cap < need)
        cap *= 2;
    Py_ssize_t *prev = PyMem_Realloc(lru->prev, cap * sizeof(Py_ssize_t));
    if (prev == NULL)
        goto nomem;
    lru->prev = prev;
    Py_ssize_t *next = PyMem_Realloc(lru->next, cap * sizeof(Py_ssize_t));
    if (next == NULL)
        goto nomem;
    lru->next = next;
    char *in = PyMem_Realloc(lru->in, cap);
    if (in == NULL)
        goto nomem;
    lru->in = in;
    memset(in + lru->cap, 0, cap - lru->cap);
    lru->cap = cap;
    return 0;
nomem:
    PyErr_NoMemory();
    return -1;
}

static inline int lru_has(LRUObject *lru, Py_ssize_t b) { return b >= 0 && b < lru->cap && lru->in[b]; }

/* Append b (not listed) at the young end. */
static inline void lru_push(LRUObject *lru, Py_ssize_t b)
{
    lru->in[b] = 1;
    lru->prev[b] = lru->tail;
    lru->next[b] = -1;
    if (lru->tail >= 0)
        lru->next[lru->tail] = b;
    else
        lru->head = b;
    lru->tail = b;
    lru->count++;
    lru->version++;
}

/* Unlink b (listed). */
static inline void lru_unlink(LRUObject *lru, Py_ssize_t b)
{
    Py_ssize_t p = lru->prev[b], n = lru->next[b];
    if (p >= 0)
        lru->next[p] = n;
    else
        lru->head = n;
    if (n >= 0)
        lru->prev[n] = p;
    else
        lru->tail = p;
    lru->in[b] = 0;
    lru->count--;
    lru->version++;
}

/* A block id from a Python object: -1 with no error set for a non-int or negative key (absent). */
static Py_ssize_t lru_key(PyObject *key)
{
    if (!PyLong_Check(key))
        return -1;
    Py_ssize_t b = PyLong_AsSsize_t(key);
    if (b == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return b < 0 ? -1 : b;
}

static PyObject *lru_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "LRU() takes no arguments");
        return NULL;
    }
    LRUObject *lru = (LRUObject *)type->tp_alloc(type, 0);
    if (lru == NULL)
        return NULL;
    lru->head = lru->tail = -1;
    return (PyObject *)lru;
}

static void lru_dealloc(LRUObject *lru)
{
    PyMem_Free(lru->prev);
    PyMem_Free(lru->next);
    PyMem_Free(lru->in);
    Py_TYPE(lru)->tp_free((PyObject *)lru);
}

static Py_ssize_t lru_len(LRUObject *lru) { return lru->count; }

static int lru_contains(LRUObject *lru, PyObject *key) { return lru_has(lru, lru_key(key)); }

static PyObject *lru_getitem(LRUObject *lru, PyObject *key)
{
    if (!lru_has(lru, lru_key(key))) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    Py_RETURN_NONE;
}

static int lru_setitem(LRUObject *lru, PyObject *key, PyObject *value)
{
    Py_ssize_t b = lru_key(key);
    if (value == NULL) { /* del lru[key] */
        if (!lru_has(lru, b)) {
            PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        lru_unlink(lru, b);
        return 0;
    }
    if (value != Py_None) {
        PyErr_SetString(PyExc_TypeError, "an LRU maps blocks to None only");
        return -1;
    }
    if (b < 0) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "an LRU lists block ids (ints >= 0), not %R", key);
        return -1;
    }
    if (lru_has(lru, b)) /* as an OrderedDict: an existing key keeps its place */
        return 0;
    if (lru_grow(lru, b + 1) < 0)
        return -1;
    lru_push(lru, b);
    return 0;
}

static PyObject *lru_popitem(LRUObject *lru, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"last", NULL};
    int last = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|p:popitem", kwlist, &last))
        return NULL;
    if (lru->count == 0) {
        PyErr_SetString(PyExc_KeyError, "dictionary is empty");
        return NULL;
    }
    Py_ssize_t b = last ? lru->tail : lru->head;
    lru_unlink(lru, b);
    PyObject *key = PyLong_FromSsize_t(b);
    if (key == NULL)
        return NULL;
    PyObject *item = PyTuple_Pack(2, key, Py_None);
    Py_DECREF(key);
    return item;
}

static PyObject *lru_pop(LRUObject *lru, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "pop expected 1 or 2 arguments");
        return NULL;
    }
    Py_ssize_t b = lru_key(args[0]);
    if (lru_has(lru, b)) {
        lru_unlink(lru, b);
        Py_RETURN_NONE;
    }
    if (nargs == 2)
        return Py_NewRef(args[1]);
    PyErr_SetObject(PyExc_KeyError, args[0]);
    return NULL;
}

typedef struct {
    PyObject_HEAD
    LRUObject *lru;
    Py_ssize_t at;
    size_t version;
} LRUIterObject;

static PyObject *lru_iter(LRUObject *lru)
{
    LRUIterObject *it = PyObject_New(LRUIterObject, &LRUIterType);
    if (it == NULL)
        return NULL;
    it->lru = (LRUObject *)Py_NewRef(lru);
    it->at = lru->head;
    it->version = lru->version;
    return (PyObject *)it;
}

static void lru_iter_dealloc(LRUIterObject *it)
{
    Py_DECREF(it->lru);
    PyObject_Free(it);
}

static PyObject *lru_iter_next(LRUIterObject *it)
{
    if (it->version != it->lru->version) {
        PyErr_SetString(PyExc_RuntimeError, "OrderedDict mutated during iteration");
        return NULL;
    }
    if (it->at < 0)
        return NULL;
    Py_ssize_t b = it->at;
    it->at = it->lru->next[b];
    return PyLong_FromSsize_t(b);
}

static PyMethodDef lru_methods[] = {
    {"popitem", (PyCFunction)(void (*)(void))lru_popitem, METH_VARARGS | METH_KEYWORDS,
     "popitem(last=True) -> (block, None): the youngest, or the oldest when last is False."},
    {"pop", (PyCFunction)(void (*)(void))lru_pop, METH_FASTCALL, "pop(block[, default]) -> None or default."},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods lru_as_mapping = {(lenfunc)lru_len, (binaryfunc)lru_getitem, (objobjargproc)lru_setitem};
static PySequenceMethods lru_as_sequence = {.sq_contains = (objobjproc)lru_contains};

static PyTypeObject LRUType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_block_core.LRU",
    .tp_basicsize = sizeof(LRUObject),
    .tp_dealloc = (destructor)lru_dealloc,
    .tp_as_mapping = &lru_as_mapping,
    .tp_as_sequence = &lru_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The LRU policy's order of evictable blocks (an OrderedDict[int, None]'s interface).",
    .tp_iter = (getiterfunc)lru_iter,
    .tp_methods = lru_methods,
    .tp_new = lru_new,
};

static PyTypeObject LRUIterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_block_core.LRUIterator",
    .tp_basicsize = sizeof(LRUIterObject),
    .tp_dealloc = (destructor)lru_iter_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)lru_iter_next,
};

/* take(free, refcount, n, key_of, block_of_key, lru, evicted_keys) -> list
 *
 * BlockPool.take(n) with the LRU policy (or no eviction): the caller checked
 * n <= len(free) + len(lru) and n > 0. Blocks come off the free list in pop order;
 * when it runs short the rest are the LRU's oldest, whose keys leave key_of and
 * block_of_key and are appended to evicted_keys. Every returned block gets refcount 1. */
static PyObject *take(PyObject *self, PyObject *args)
{
    PyObject *free, *refcount, *key_of, *block_of_key, *lru, *evicted_keys;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OOnOOOO", &free, &refcount, &n, &key_of, &block_of_key, &lru, &evicted_keys))
        return NULL;
    if (check_list(free, "free") || check_list(refcount, "refcount") || check_list(key_of, "key_of") ||
        check_list(evicted_keys, "evicted_keys"))
        return NULL;
    Py_ssize_t nfree = PyList_GET_SIZE(free);
    if (n < 0)
        n = 0;
    Py_ssize_t from_free = n < nfree ? n : nfree;
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t j = 0; j < from_free; j++) {
        PyObject *b = PyList_GET_ITEM(free, nfree - 1 - j);
        Py_INCREF(b);
        PyList_SET_ITEM(out, j, b);
    }
    Py_ssize_t k = n - from_free;
    if (k > 0 && IS_LRU(lru)) { /* the k oldest, straight from the list */
        LRUObject *order = (LRUObject *)lru;
        if (order->count < k) {
            PyErr_SetString(PyExc_RuntimeError, "take: the LRU holds fewer blocks than checked");
            goto fail_partial;
        }
        Py_ssize_t b = order->head;
        for (Py_ssize_t j = 0; j < k; j++, b = order->next[b]) {
            PyObject *block = PyLong_FromSsize_t(b);
            if (block == NULL)
                goto fail_partial;
            PyList_SET_ITEM(out, from_free + j, block);
        }
    } else if (k > 0) {
        /* victims = list(islice(lru, k)), then each leaves the LRU and the key map */
        PyObject *it = PyObject_GetIter(lru);
        if (it == NULL)
            goto fail_partial;
        for (Py_ssize_t j = 0; j < k; j++) {
            PyObject *b = PyIter_Next(it);
            if (b == NULL) {
                Py_DECREF(it);
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_RuntimeError, "take: the LRU holds fewer blocks than checked");
                goto fail_partial;
            }
            PyList_SET_ITEM(out, from_free + j, b);
        }
        Py_DECREF(it);
    }
    /* From here on the state changes, in the Python code's order. */
    if (PyList_SetSlice(free, nfree - from_free, nfree, NULL) < 0)
        goto fail;
    for (Py_ssize_t j = from_free; j < n; j++) {
        PyObject *b = PyList_GET_ITEM(out, j);
        if (IS_LRU(lru))
            lru_unlink((LRUObject *)lru, ((LRUObject *)lru)->head); /* b is the oldest now */
        else if (PyObject_DelItem(lru, b) < 0)
            goto fail;
        PyObject *key = forget_key(b, key_of, block_of_key);
        if (key == NULL)
            goto fail;
        int r = PyList_Append(evicted_keys, key);
        Py_DECREF(key);
        if (r < 0)
            goto fail;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_ssize_t i = list_index(refcount, PyList_GET_ITEM(out, j));
        if (i < 0)
            goto fail;
        list_store(refcount, i, one_long);
    }
    return out;
fail_partial:
    /* items not yet set are NULL; PyList dealloc skips them */
fail:
    Py_DECREF(out);
    return NULL;
}

/* release(blocks, reverse, refcount, key_of, pins, free, lru) -> None or int
 *
 * BlockPool.free(blocks) (blocks reversed first when `reverse`) with the LRU policy:
 * drop one reference from each block in order; one that reaches 0 goes to the free
 * list when unkeyed, else to the LRU's young end unless pinned. Returns None, or the
 * first block whose refcount was already 0 (the blocks before it were released; the
 * caller raises IntegrityError). */
static PyObject *release(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("release", nargs, 7))
        return NULL;
    PyObject *blocks = args[0], *refcount = args[2], *key_of = args[3], *pins = args[4], *free = args[5];
    PyObject *lru = args[6];
    int reverse = PyObject_IsTrue(args[1]);
    if (reverse < 0)
        return NULL;
    if (!PyDict_Check(pins)) {
        PyErr_SetString(PyExc_TypeError, "pins must be a dict");
        return NULL;
    }
    if (check_list(refcount, "refcount") || check_list(key_of, "key_of") || check_list(free, "free"))
        return NULL;
    PyObject *seq = PySequence_Fast(blocks, "blocks must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int same_size = PyList_GET_SIZE(key_of) == PyList_GET_SIZE(refcount); /* then a block's index is one */
    /* With the compiled LRU nothing below runs Python code, so the free list grows once by n and
     * keeps the blocks that become free (its size is set to what it holds on every exit). */
    Py_ssize_t nfree0 = PyList_GET_SIZE(free), nfreed = 0;
    PyObject **freed = NULL;
    if (IS_LRU(lru) && n > 0 && free != blocks) {
        if ((freed = list_grow(free, n)) == NULL)
            goto fail;
        memset(freed, 0, n * sizeof(PyObject *)); /* NULL until filled: what a traversal may see */
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *b = items[reverse ? n - 1 - j : j];
        Py_ssize_t i = list_index(refcount, b);
        if (i < 0)
            goto fail;
        Py_ssize_t rc = int_value(PyList_GET_ITEM(refcount, i));
        if (rc == -1 && PyErr_Occurred())
            goto fail;
        rc -= 1;
        if (rc) {
            if (rc < 0) {
                if (freed != NULL)
                    Py_SET_SIZE(free, nfree0 + nfreed);
                Py_INCREF(b);
                Py_DECREF(seq);
                return b;
            }
            PyObject *v = PyLong_FromSsize_t(rc);
            if (v == NULL)
                goto fail;
            list_store(refcount, i, v);
            Py_DECREF(v);
            continue;
        }
        list_store(refcount, i, zero_long);
        Py_ssize_t ki = same_size ? i : list_index(key_of, b);
        if (ki < 0)
            goto fail;
        if (PyList_GET_ITEM(key_of, ki) == Py_None) {
            if (freed != NULL)
                freed[nfreed++] = Py_NewRef(b);
            else if (PyList_Append(free, b) < 0)
                goto fail;
        } else {
            int pinned = PyDict_GET_SIZE(pins) ? PyDict_Contains(pins, b) : 0;
            if (pinned < 0)
                goto fail;
            if (pinned) {
                /* pinned blocks are listed nowhere */
            } else if (IS_LRU(lru)) {
                if (lru_setitem((LRUObject *)lru, b, Py_None) < 0)
                    goto fail;
            } else if (PyObject_SetItem(lru, b, Py_None) < 0) {
                goto fail;
            }
        }
    }
    if (freed != NULL)
        Py_SET_SIZE(free, nfree0 + nfreed);
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail:
    if (freed != NULL)
        Py_SET_SIZE(free, nfree0 + nfreed);
    Py_DECREF(seq);
    return NULL;
}

static int open_blocks(PyObject *batch, PyObject *opened, PyObject *free, PyObject *refcount);

/* step(token_lists, token_ids, batch, opened, free, refcount, keep_ids) -> bool
 *
 * The decode group's step for members that need no Python: token_lists[i].append(
 * token_ids[i]) for every member (unless keep_ids is False, a manager without prefix
 * caching: then the group's step count holds the new tokens), then each member listed
 * in `opened` (indices into batch, in order) takes the next free block: refcount 1,
 * appended to its table, a None key and a 0.0 score. Returns False, changing nothing, when the free list holds
 * fewer blocks than `opened` needs (the caller takes the general path, which evicts). */
static PyObject *step(PyObject *self, PyObject *args)
{
    PyObject *token_lists, *token_ids, *batch, *opened, *free, *refcount;
    int keep_ids;
    if (!PyArg_ParseTuple(args, "OOOOOOp", &token_lists, &token_ids, &batch, &opened, &free, &refcount,
                          &keep_ids))
        return NULL;
    if (check_list(token_lists, "token_lists") || check_list(batch, "batch") || check_list(opened, "opened") ||
        check_list(free, "free") || check_list(refcount, "refcount"))
        return NULL;
    Py_ssize_t nopen = PyList_GET_SIZE(opened);
    if (nopen > PyList_GET_SIZE(free))
        Py_RETURN_FALSE;
    PyObject *tokens = PySequence_Fast(token_ids, "token_ids must be a sequence");
    if (tokens == NULL)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(token_lists);
    if (PySequence_Fast_GET_SIZE(tokens) != n) {
        Py_DECREF(tokens);
        PyErr_SetString(PyExc_ValueError, "step: one token per member");
        return NULL;
    }
    PyObject **tok = PySequence_Fast_ITEMS(tokens);
    for (Py_ssize_t i = 0; keep_ids && i < n; i++) {
        PyObject *lst = PyList_GET_ITEM(token_lists, i);
        if (!PyList_Check(lst) || PyList_Append(lst, tok[i]) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "token_lists must hold lists");
            Py_DECREF(tokens);
            return NULL;
        }
    }
    Py_DECREF(tokens);
    if (open_blocks(batch, opened, free, refcount) < 0)
        return NULL;
    Py_RETURN_TRUE;
}

/* Each member of batch listed in `opened` (in order) takes the next free block, as
 * KVCacheManager._open_block does without eviction. The caller checked the free list. */
static int open_blocks(PyObject *batch, PyObject *opened, PyObject *free, PyObject *refcount)
{
    Py_ssize_t nopen = PyList_GET_SIZE(opened);
    for (Py_ssize_t j = 0; j < nopen; j++) {
        Py_ssize_t idx = int_value(PyList_GET_ITEM(opened, j));
        if (idx < 0 || idx >= PyList_GET_SIZE(batch)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_IndexError, "step: member index out of range");
            return -1;
        }
        PyObject *seq = PyList_GET_ITEM(batch, idx);
        PyObject *block = list_pop(free);
        if (block == NULL)
            return -1;
        Py_ssize_t i = list_index(refcount, block);
        if (i < 0) {
            Py_DECREF(block);
            return -1;
        }
        list_store(refcount, i, one_long);
        PyObject *table = slot_get(seq, s_table);
        int r = table == NULL ? -1 : PyList_Append(table, block);
        Py_XDECREF(table);
        Py_DECREF(block);
        if (r < 0)
            return -1;
        PyObject *keys = slot_get(seq, s_keys);
        r = keys == NULL ? -1 : PyList_Append(keys, Py_None);
        Py_XDECREF(keys);
        if (r < 0)
            return -1;
        PyObject *scores = slot_get(seq, s_scores);
        r = scores == NULL ? -1 : PyList_Append(scores, zero_float);
        Py_XDECREF(scores);
        if (r < 0)
            return -1;
    }
    return 0;
}

/* step_pairs(group, pairs, free, refcount, lru, keep_ids) -> list or None
 *
 * KVCacheManager.reserve_token_pairs(pairs) while `group` (a _DecodeGroup) holds: when the
 * pairs name exactly the group's members in order (pairs[i] is a 2-tuple and pairs[i][0] ==
 * ids[i]) and the pool has a block for each (len(free) + len(lru) >= len(pairs)), this is step
 * t = group.num_steps + 1: pairs[i][1] is appended to token_lists[i] (unless keep_ids is
 * False: then the step count holds the new tokens), the members opening a block this step
 * (by_fill[(1 - t) % block_size]) take the next free block each when the free list holds
 * enough (else none does: they evict, in Python), and group.num_steps becomes t. Returns the
 * members still to open (an empty tuple, or a list of all of them), or None, having changed
 * nothing, when the pairs do not fit the group. */
static PyObject *step_pairs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("step_pairs", nargs, 6))
        return NULL;
    PyObject *group = args[0], *pairs = args[1], *free = args[2], *refcount = args[3], *lru = args[4];
    int keep_ids = PyObject_IsTrue(args[5]);
    if (keep_ids < 0)
        return NULL;
    if (check_list(free, "free") || check_list(refcount, "refcount"))
        return NULL;
    PyObject *ids = NULL, *token_lists = NULL, *batch = NULL, *by_fill = NULL, *steps = NULL, *seq = NULL;
    PyObject *result = NULL;
    if (!(ids = slot_get(group, s_ids)) || !(token_lists = slot_get(group, s_token_lists)) ||
        !(batch = slot_get(group, s_batch)) || !(by_fill = slot_get(group, s_by_fill)) ||
        !(steps = slot_get(group, s_num_steps))) /* the first missing one raises */
        goto done;
    if (!PyTuple_CheckExact(ids)) {
        PyErr_SetString(PyExc_TypeError, "step_pairs: the group's ids must be a tuple");
        goto done;
    }
    if (check_list(token_lists, "token_lists") || check_list(batch, "batch") || check_list(by_fill, "by_fill"))
        goto done;
    Py_ssize_t n = PyTuple_GET_SIZE(ids), bs = PyList_GET_SIZE(by_fill), nfree = PyList_GET_SIZE(free);
    Py_ssize_t t = PyLong_AsSsize_t(steps);
    if (t == -1 && PyErr_Occurred())
        goto done;
    t += 1;
    Py_ssize_t available = IS_LRU(lru) ? ((LRUObject *)lru)->count : PyObject_Length(lru);
    if (available < 0)
        goto done;
    if (bs == 0 || PyList_GET_SIZE(token_lists) != n || PyList_GET_SIZE(batch) != n || n > nfree + available) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    PyObject *opened = PyList_GET_ITEM(by_fill, ((1 - t) % bs + bs) % bs);
    if (check_list(opened, "by_fill[r]"))
        goto done;
    seq = PySequence_Fast(pairs, "pairs must be a sequence");
    if (seq == NULL)
        goto done;
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) { /* check every pair before changing anything */
        PyObject *pair = items[i];
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        PyObject *id = PyTuple_GET_ITEM(pair, 0), *want = PyTuple_GET_ITEM(ids, i);
        int same = id == want ? 1 : PyObject_RichCompareBool(id, want, Py_EQ);
        if (same <= 0) {
            if (same == 0)
                result = Py_NewRef(Py_None);
            goto done;
        }
    }
    for (Py_ssize_t i = 0; keep_ids && i < n; i++) {
        PyObject *lst = PyList_GET_ITEM(token_lists, i);
        if (!PyList_Check(lst) || PyList_Append(lst, PyTuple_GET_ITEM(items[i], 1)) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "token_lists must hold lists");
            goto done;
        }
    }
    int opens_here = PyList_GET_SIZE(opened) <= nfree;
    if (opens_here && open_blocks(batch, opened, free, refcount) < 0)
        goto done;
    PyObject *now = PyLong_FromSsize_t(t);
    int r = now == NULL ? -1 : slot_set(group, s_num_steps, now);
    Py_XDECREF(now);
    if (r < 0)
        goto done;
    result = opens_here ? PyTuple_New(0) : PyList_GetSlice(opened, 0, PyList_GET_SIZE(opened));
done:
    Py_XDECREF(ids);
    Py_XDECREF(token_lists);
    Py_XDECREF(batch);
    Py_XDECREF(by_fill);
    Py_XDECREF(steps);
    Py_XDECREF(seq);
    return result;
}

/* prefill(seq, token_ids, block_size, free, refcount, keep_ids) -> int or None
 *
 * KVCacheManager.reserve(seq, token_ids) for a sequence without a budget when no
 * copy-on-write and no eviction is needed: the blocks the new tokens need come off
 * the free list (refcount 1) onto seq.table with None keys and 0.0 scores, the tokens
 * are appended (unless keep_ids is False, a manager without prefix caching: then they
 * are only counted in seq.num_elided_tokens), seq.simple becomes True, and the first new position
 * is returned. The
 * caller publishes the blocks that became full. Returns None, having changed nothing,
 * when the sequence's partial last block is shared, the free list is short, or the lists
 * alias one another. */
static PyObject *prefill(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("prefill", nargs, 6))
        return NULL;
    PyObject *seq = args[0], *token_ids = args[1], *free = args[3], *refcount = args[4];
    Py_ssize_t bs = PyLong_AsSsize_t(args[2]);
    if (bs == -1 && PyErr_Occurred())
        return NULL;
    int keep_ids = PyObject_IsTrue(args[5]);
    if (keep_ids < 0)
        return NULL;
    if (check_list(free, "free") || check_list(refcount, "refcount"))
        return NULL;
    if (bs <= 0) {
        PyErr_SetString(PyExc_ValueError, "prefill: block_size must be positive");
        return NULL;
    }
    PyObject *tokens = NULL, *table = NULL, *keys = NULL, *scores = NULL, *dropped = NULL, *elided = NULL;
    PyObject *result = NULL;
    Py_ssize_t n = PyObject_Length(token_ids);
    if (n < 0)
        return NULL;
    if (!(tokens = slot_get(seq, s_tokens)) || !(table = slot_get(seq, s_table)) ||
        !(keys = slot_get(seq, s_keys)) || !(scores = slot_get(seq, s_scores)) ||
        !(dropped = slot_get(seq, s_num_dropped_tokens)) || !(elided = slot_get(seq, s_num_elided_tokens)))
        goto done; /* the first missing one raises */
    if (!PyList_CheckExact(tokens) || !PyList_CheckExact(table) || !PyList_CheckExact(keys) ||
        !PyList_CheckExact(scores)) {
        PyErr_SetString(PyExc_TypeError, "prefill: the sequence's tokens, table, keys and scores must be lists");
        goto done;
    }
    Py_ssize_t num_dropped = PyLong_AsSsize_t(dropped);
    if (num_dropped == -1 && PyErr_Occurred())
        goto done;
    Py_ssize_t num_elided = PyLong_AsSsize_t(elided);
    if (num_elided == -1 && PyErr_Occurred())
        goto done;
    Py_ssize_t start = PyList_GET_SIZE(tokens) + num_elided - num_dropped; /* cache_len */
    Py_ssize_t ntable = PyList_GET_SIZE(table);
    if (start % bs != 0) { /* a partial last block: copy-on-write when shared */
        if (ntable == 0) {
            PyErr_SetString(PyExc_RuntimeError, "prefill: a partial block but an empty table");
            goto done;
        }
        Py_ssize_t i = list_index(refcount, PyList_GET_ITEM(table, ntable - 1));
        if (i < 0)
            goto done;
        long rc = PyLong_AsLong(PyList_GET_ITEM(refcount, i));
        if (rc == -1 && PyErr_Occurred())
            goto done;
        if (rc > 1) {
            result = Py_NewRef(Py_None);
            goto done;
        }
    }
    Py_ssize_t need = (start + n + bs - 1) / bs - ntable;
    Py_ssize_t nfree = PyList_GET_SIZE(free);
    if (need > nfree) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (need > 0) {
        for (Py_ssize_t j = 0; j < need; j++) /* every block a valid index, before changing anything */
            if (list_index(refcount, PyList_GET_ITEM(free, nfree - 1 - j)) < 0)
                goto done;
        /* The table, keys and scores grow by `need` each (one resize per list, undone if one fails),
         * then the blocks move off the free list's end onto the table in pop order with refcount
         * 1, each with a None key and a 0.0 score, as take() + the extends do. */
        if (table == keys || table == scores || keys == scores || free == table || free == keys || free == scores) {
            result = Py_NewRef(Py_None); /* lists that alias each other: the Python path */
            goto done;
        }
        Py_ssize_t nkeys = PyList_GET_SIZE(keys);
        PyObject **slots = list_grow(table, need), **kslots = NULL, **sslots = NULL;
        if (slots == NULL || (kslots = list_grow(keys, need)) == NULL ||
            (sslots = list_grow(scores, need)) == NULL) {
            if (slots != NULL)
                Py_SET_SIZE(table, ntable);
            if (kslots != NULL)
                Py_SET_SIZE(keys, nkeys);
            goto done;
        }
        for (Py_ssize_t j = 0; j < need; j++) {
            PyObject *b = PyList_GET_ITEM(free, nfree - 1 - j); /* the free list's reference moves */
            list_store(refcount, list_index(refcount, b), one_long);
            slots[j] = b;
            kslots[j] = Py_NewRef(Py_None);
            sslots[j] = Py_NewRef(zero_float);
        }
        Py_SET_SIZE(free, nfree - need);
    }
    if (keep_ids) {
        PyObject *joined = PySequence_InPlaceConcat(tokens, token_ids); /* seq.tokens += token_ids */
        if (joined == NULL)
            goto done;
        Py_DECREF(joined);
    } else { /* seq.num_elided_tokens += n */
        PyObject *count = PyLong_FromSsize_t(num_elided + n);
        int r = count == NULL ? -1 : slot_set(seq, s_num_elided_tokens, count);
        Py_XDECREF(count);
        if (r < 0)
            goto done;
    }
    if (slot_set(seq, s_simple, Py_True) < 0)
        goto done;
    result = PyLong_FromSsize_t(start);
done:
    Py_XDECREF(tokens);
    Py_XDECREF(table);
    Py_XDECREF(keys);
    Py_XDECREF(scores);
    Py_XDECREF(dropped);
    Py_XDECREF(elided);
    return result;
}

/* open_block(seq, free, refcount, key_of, block_of_key, lru) -> bytes or None
 *
 * KVCacheManager._open_block(seq) for a pool without a lower tier: the next free
 * block, else the LRU's oldest (its key leaves key_of and block_of_key and is
 * returned, for the caller's counters and REMOVED event), gets refcount 1 and is
 * appended to seq.table with a None key and a 0.0 score. The caller checked that
 * the free list or the LRU is not empty. */
static PyObject *open_block(PyObject *self, PyObject *args)
{
    PyObject *seq, *free, *refcount, *key_of, *block_of_key, *lru;
    if (!PyArg_ParseTuple(args, "OOOOOO", &seq, &free, &refcount, &key_of, &block_of_key, &lru))
        return NULL;
    if (check_list(free, "free") || check_list(refcount, "refcount") || check_list(key_of, "key_of"))
        return NULL;
    PyObject *block, *lost = Py_NewRef(Py_None);
    int from_free = PyList_GET_SIZE(free) > 0;
    if (from_free) {
        block = list_pop(free);
        if (block == NULL)
            goto fail;
    } else if (IS_LRU(lru)) { /* lru.popitem(last=False) */
        LRUObject *order = (LRUObject *)lru;
        if (order->count == 0) {
            PyErr_SetString(PyExc_RuntimeError, "open_block: no free or evictable block");
            goto fail;
        }
        Py_ssize_t oldest = order->head;
        lru_unlink(order, oldest);
        block = PyLong_FromSsize_t(oldest);
        if (block == NULL)
            goto fail;
    } else { /* lru.popitem(last=False) */
        PyObject *it = PyObject_GetIter(lru);
        if (it == NULL)
            goto fail;
        block = PyIter_Next(it);
        Py_DECREF(it);
        if (block == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "open_block: no free or evictable block");
            goto fail;
        }
        if (PyObject_DelItem(lru, block) < 0)
            goto fail_block;
    }
    if (!from_free) { /* the evicted block's key goes */
        PyObject *key = forget_key(block, key_of, block_of_key);
        if (key == NULL)
            goto fail_block;
        Py_SETREF(lost, key);
    }
    Py_ssize_t i = list_index(refcount, block);
    if (i < 0)
        goto fail_block;
    list_store(refcount, i, one_long);
    PyObject *table = slot_get(seq, s_table);
    int r = table == NULL ? -1 : PyList_Append(table, block);
    Py_XDECREF(table);
    if (r < 0)
        goto fail_block;
    Py_DECREF(block);
    PyObject *keys = slot_get(seq, s_keys);
    r = keys == NULL ? -1 : PyList_Append(keys, Py_None);
    Py_XDECREF(keys);
    if (r < 0)
        goto fail;
    PyObject *scores = slot_get(seq, s_scores);
    r = scores == NULL ? -1 : PyList_Append(scores, zero_float);
    Py_XDECREF(scores);
    if (r < 0)
        goto fail;
    return lost;
fail_block:
    Py_DECREF(block);
fail:
    Py_DECREF(lost);
    return NULL;
}

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
 * chain_keys(parent, tokens[first:first + block_size], block_size)[0], hashed by the
 * compiled chain without slicing or packing in Python. The loader only offers this
 * when set_chain() was given the chain. */
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
    if (check_list(tokens, "tokens"))
        return NULL;
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

/* One evicting-or-free open for finish_step(): open_block()'s work plus what the manager does
 * with an evicted key when there is no lower tier (origin.pop(key, None), a REMOVED event).
 * Returns 1 when it evicted, 0 when the block was free, -1 on error. */
static int step_open(PyObject *seq, PyObject *free, PyObject *refcount, PyObject *key_of, PyObject *block_of_key,
                     PyObject *lru, PyObject *origin, PyObject *event_kinds, PyObject *event_keys, PyObject *removed)
{
    PyObject *args = PyTuple_Pack(6, seq, free, refcount, key_of, block_of_key, lru);
    if (args == NULL)
        return -1;
    PyObject *lost = open_block(NULL, args);
    Py_DECREF(args);
    if (lost == NULL)
        return -1;
    if (lost == Py_None) {
        Py_DECREF(lost);
        return 0;
    }
    int r = 0;
    if (PyDict_GET_SIZE(origin)) {
        PyObject *gone = PyObject_CallMethod(origin, "pop", "OO", lost, Py_None);
        if (gone == NULL)
            r = -1;
        Py_XDECREF(gone);
    }
    if (r == 0 && event_kinds != Py_None &&
        (PyList_Append(event_kinds, removed) < 0 || PyList_Append(event_keys, lost) < 0))
        r = -1;
    Py_DECREF(lost);
    return r < 0 ? -1 : 1;
}

/* One publish for finish_step(): KVCacheManager._publish_one(seq, i) for a sequence without
 * a hint, no held publishing and no lower tier. Returns 0, or -1 on error. */
static int step_publish(PyObject *seq, Py_ssize_t i, Py_ssize_t bs, PyObject *key_of, PyObject *block_of_key,
                        PyObject *event_kinds, PyObject *event_keys, PyObject *stored)
{
    int r = -1;
    PyObject *keys = NULL, *tokens = NULL, *table = NULL, *root = NULL, *key = NULL;
    if (!(keys = slot_get(seq, s_keys)) || !(tokens = slot_get(seq, s_tokens)) || !(table = slot_get(seq, s_table)))
        goto done; /* the first missing one raises */
    if (!PyList_CheckExact(keys) || !PyList_CheckExact(table) || i >= PyList_GET_SIZE(keys) ||
        i >= PyList_GET_SIZE(table)) {
        PyErr_SetString(PyExc_RuntimeError, "finish_step: a filled block outside the table");
        goto done;
    }
    PyObject *parent;
    if (i) {
        parent = PyList_GET_ITEM(keys, i - 1);
    } else {
        root = slot_get(seq, s_root);
        if (root == NULL)
            goto done;
        parent = root;
    }
    if (parent == Py_None) {
        PyErr_SetString(PyExc_AssertionError, "finish_step: the filled block's parent has no key");
        goto done;
    }
    PyObject *kargs = Py_BuildValue("(OOnn)", parent, tokens, i * bs, bs);
    if (kargs == NULL)
        goto done;
    key = block_key(NULL, kargs);
    Py_DECREF(kargs);
    if (key == NULL)
        goto done;
    list_store(keys, i, key); /* seq.keys[i] = key */
    PyObject *block = PyList_GET_ITEM(table, i);
    Py_ssize_t bi = list_index(key_of, block);
    if (bi < 0)
        goto done;
    if (PyList_GET_ITEM(key_of, bi) != Py_None) { /* BlockPool.publish() refusing */
        r = 0;
        goto done;
    }
    int held = PyDict_Contains(block_of_key, key);
    if (held != 0) {
        r = held < 0 ? -1 : 0;
        goto done;
    }
    list_store(key_of, bi, key);
    if (PyDict_SetItem(block_of_key, key, block) < 0)
        goto done;
    if (event_kinds != Py_None &&
        (PyList_Append(event_kinds, stored) < 0 || PyList_Append(event_keys, key) < 0))
        goto done;
    r = 0;
done:
    Py_XDECREF(keys);
    Py_XDECREF(tokens);
    Py_XDECREF(table);
    Py_XDECREF(root);
    Py_XDECREF(key);
    return r;
}

/* finish_step(batch, opened, filled, bs, free, refcount, key_of, block_of_key, lru, origin,
 *             event_kinds, event_keys, stored, removed) -> int or None
 *
 * KVCacheManager._finish_step for a pool without a lower tier and without held publishing:
 * the members in `opened` get their next block (free, else the LRU's oldest, whose key leaves
 * and is announced REMOVED) and the blocks of the members in `filled` (whose chain is intact)
 * get their keys (announced STORED), in batch order, as the Python code does. event_kinds is
 * None when events are not recorded. Returns the number of evictions (for the counters), or
 * None, having changed nothing, when a filled member still carries its prompt's key hint (the
 * Python path reuses those keys) or no key chain is compiled in. */
static PyObject *finish_step(PyObject *self, PyObject *args)
{
    PyObject *batch, *opened, *filled, *free, *refcount, *key_of, *block_of_key, *lru, *origin;
    PyObject *event_kinds, *event_keys, *stored, *removed;
    Py_ssize_t bs;
    if (!PyArg_ParseTuple(args, "OOOnOOOO!OO!OOOO", &batch, &opened, &filled, &bs, &free, &refcount, &key_of,
                          &PyDict_Type, &block_of_key, &lru, &PyDict_Type, &origin, &event_kinds, &event_keys,
                          &stored, &removed))
        return NULL;
    if (check_list(batch, "batch") || check_list(opened, "opened") || check_list(filled, "filled") ||
        check_list(free, "free") || check_list(refcount, "refcount") || check_list(key_of, "key_of"))
        return NULL;
    if (event_kinds != Py_None && (check_list(event_kinds, "event_kinds") || check_list(event_keys, "event_keys")))
        return NULL;
    Py_ssize_t nopen = PyList_GET_SIZE(opened), nfill = PyList_GET_SIZE(filled), nbatch = PyList_GET_SIZE(batch);
    if (nfill && chain_keys == NULL)
        Py_RETURN_NONE;
    for (Py_ssize_t j = 0; j < nfill; j++) { /* every filled member hint-free, before changing anything */
        Py_ssize_t m = PyLong_AsSsize_t(PyList_GET_ITEM(filled, j));
        if (m < 0 || m >= nbatch) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_IndexError, "finish_step: member index out of range");
            return NULL;
        }
        PyObject *hint = slot_get(PyList_GET_ITEM(batch, m), s_hint);
        if (hint == NULL)
            return NULL;
        int has_hint = hint != Py_None;
        Py_DECREF(hint);
        if (has_hint)
            Py_RETURN_NONE;
    }
    long evictions = 0;
    Py_ssize_t a = 0, b = 0;
    while (a < nopen || b < nfill) { /* the two ascending index lists, merged: batch order */
        Py_ssize_t ia = a < nopen ? PyLong_AsSsize_t(PyList_GET_ITEM(opened, a)) : PY_SSIZE_T_MAX;
        Py_ssize_t ib = b < nfill ? PyLong_AsSsize_t(PyList_GET_ITEM(filled, b)) : PY_SSIZE_T_MAX;
        if (PyErr_Occurred())
            return NULL;
        if (ia <= ib) {
            if (ia < 0 || ia >= nbatch) {
                PyErr_SetString(PyExc_IndexError, "finish_step: member index out of range");
                return NULL;
            }
            int r = step_open(PyList_GET_ITEM(batch, ia), free, refcount, key_of, block_of_key, lru, origin,
                              event_kinds, event_keys, removed);
            if (r < 0)
                return NULL;
            evictions += r;
            a++;
        } else {
            PyObject *seq = PyList_GET_ITEM(batch, ib);
            PyObject *intact = slot_get(seq, s_chain_intact);
            if (intact == NULL)
                return NULL;
            int ok = PyObject_IsTrue(intact);
            Py_DECREF(intact);
            if (ok < 0)
                return NULL;
            if (ok) {
                PyObject *tokens = slot_get(seq, s_tokens);
                if (tokens == NULL)
                    return NULL;
                Py_ssize_t ntok = PyObject_Length(tokens);
                Py_DECREF(tokens);
                if (ntok < 0)
                    return NULL;
                if (step_publish(seq, ntok / bs - 1, bs, key_of, block_of_key, event_kinds, event_keys, stored) <
                    0)
                    return NULL;
            }
            b++;
        }
    }
    return PyLong_FromLong(evictions);
}

/* split_pairs(pairs) -> (ids, tokens) or None
 *
 * zip(*pairs) for a decode step's (seq_id, token) pairs when every pair is a tuple of two:
 * the ids and the tokens as two tuples, in order (an empty list gives two empty tuples).
 * Returns None when pairs is not a list or tuple or some pair is not a 2-tuple (the caller's
 * check and zip() take those, with their errors). */
static PyObject *split_pairs(PyObject *self, PyObject *pairs)
{
    if (!PyList_CheckExact(pairs) && !PyTuple_CheckExact(pairs))
        Py_RETURN_NONE;
    PyObject *seq = PySequence_Fast(pairs, "pairs must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyTuple_Check(items[i]) || PyTuple_GET_SIZE(items[i]) != 2) {
            Py_DECREF(seq);
            Py_RETURN_NONE;
        }
    PyObject *ids = PyTuple_New(n), *tokens = PyTuple_New(n);
    if (ids == NULL || tokens == NULL) {
        Py_XDECREF(ids);
        Py_XDECREF(tokens);
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyTuple_SET_ITEM(ids, i, Py_NewRef(PyTuple_GET_ITEM(items[i], 0)));
        PyTuple_SET_ITEM(tokens, i, Py_NewRef(PyTuple_GET_ITEM(items[i], 1)));
    }
    Py_DECREF(seq);
    PyObject *result = PyTuple_Pack(2, ids, tokens);
    Py_DECREF(ids);
    Py_DECREF(tokens);
    return result;
}

/* new_sequence(template, seq_id, root) -> a Sequence
 *
 * Sequence(seq_id, root, [], [], [], []) without running the generated __init__ (its fourteen
 * slot stores cost ~0.5 us, once per KVCacheManager.open() without a cached prefix): a new
 * instance of template's class whose every slot holds what template's holds, except that each
 * list gets a new empty list (template's must be empty) and seq_id and root are set. template
 * is an instance, made by __init__ with those empty lists, of a class with __slots__ only
 * (no __dict__, no weak references) directly over object. */
static PyTypeObject *named_type;       /* the last template class new_sequence() saw (a reference) */
static Py_ssize_t named_offsets[2];     /* and its seq_id and root slots' offsets */

static PyObject *new_sequence(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("new_sequence", nargs, 3))
        return NULL;
    PyObject *template = args[0];
    PyTypeObject *tp = Py_TYPE(template);
    if (!(tp->tp_flags & Py_TPFLAGS_HEAPTYPE) || tp->tp_base != &PyBaseObject_Type || tp->tp_dictoffset != 0 ||
        tp->tp_weaklistoffset != 0 || tp->tp_members == NULL) {
        PyErr_SetString(PyExc_TypeError, "new_sequence: the template's class must have __slots__ only");
        return NULL;
    }
    for (PyMemberDef *m = tp->tp_members; m->name != NULL; m++) {
        PyObject *v = *(PyObject **)((char *)template + m->offset);
        if (m->type != T_OBJECT_EX ||
            (v != NULL && PyList_Check(v) && (!PyList_CheckExact(v) || PyList_GET_SIZE(v) != 0))) {
            PyErr_Format(PyExc_TypeError, "new_sequence: the template's slot %s must be an object or an empty list",
                         m->name);
            return NULL;
        }
    }
    if (tp != named_type) { /* find seq_id's and root's offsets once per class */
        Py_ssize_t id_offset = -1, root_offset = -1;
        for (PyMemberDef *m = tp->tp_members; m->name != NULL; m++) {
            if (strcmp(m->name, "seq_id") == 0)
                id_offset = m->offset;
            else if (strcmp(m->name, "root") == 0)
                root_offset = m->offset;
        }
        if (id_offset < 0 || root_offset < 0) {
            PyErr_SetString(PyExc_TypeError, "new_sequence: the template's class has no seq_id or no root slot");
            return NULL;
        }
        Py_INCREF(tp);
        Py_XSETREF(named_type, tp);
        named_offsets[0] = id_offset;
        named_offsets[1] = root_offset;
    }
    PyObject *seq = tp->tp_alloc(tp, 0); /* every slot NULL (unset) until filled below */
    if (seq == NULL)
        return NULL;
    for (PyMemberDef *m = tp->tp_members; m->name != NULL; m++) {
        PyObject *v = *(PyObject **)((char *)template + m->offset), *copy;
        if (m->offset == named_offsets[0] || m->offset == named_offsets[1]) {
            copy = Py_NewRef(args[m->offset == named_offsets[0] ? 1 : 2]);
        } else if (v != NULL && PyList_Check(v)) {
            if ((copy = PyList_New(0)) == NULL) {
                Py_DECREF(seq);
                return NULL;
            }
        } else {
            copy = Py_XNewRef(v);
        }
        *(PyObject **)((char *)seq + m->offset) = copy;
    }
    return seq;
}

/* group_fills(batch, block_size, group) -> list[list[int]]
 *
 * A new decode group's schedule (_DecodeGroup.by_fill): by_fill[r] lists, in order, the
 * indices of the sequences of batch whose length (len(tokens) + num_elided_tokens: no group
 * counts their tokens yet) is r modulo block_size. When group is not None (a manager without
 * prefix caching) each sequence's decode_group becomes group, which counts its tokens from now. */
static PyObject *group_fills(PyObject *self, PyObject *args)
{
    PyObject *batch, *group;
    Py_ssize_t bs;
    if (!PyArg_ParseTuple(args, "OnO", &batch, &bs, &group))
        return NULL;
    if (check_list(batch, "batch"))
        return NULL;
    if (bs <= 0) {
        PyErr_SetString(PyExc_ValueError, "group_fills: block_size must be positive");
        return NULL;
    }
    PyObject *by_fill = PyList_New(bs);
    if (by_fill == NULL)
        return NULL;
    for (Py_ssize_t r = 0; r < bs; r++) {
        PyObject *members = PyList_New(0);
        if (members == NULL)
            goto fail;
        PyList_SET_ITEM(by_fill, r, members);
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(batch); i++) {
        PyObject *seq = PyList_GET_ITEM(batch, i);
        PyObject *tokens = slot_get(seq, s_tokens);
        Py_ssize_t length = tokens == NULL ? -1 : PyObject_Length(tokens);
        Py_XDECREF(tokens);
        if (length < 0)
            goto fail;
        PyObject *elided = slot_get(seq, s_num_elided_tokens);
        Py_ssize_t num_elided = elided == NULL ? -1 : PyLong_AsSsize_t(elided);
        Py_XDECREF(elided);
        if (num_elided == -1 && PyErr_Occurred())
            goto fail;
        PyObject *index = PyLong_FromSsize_t(i);
        int r = index == NULL ? -1 : PyList_Append(PyList_GET_ITEM(by_fill, (length + num_elided) % bs), index);
        Py_XDECREF(index);
        if (r < 0)
            goto fail;
    }
    for (Py_ssize_t i = 0; group != Py_None && i < PyList_GET_SIZE(batch); i++)
        if (slot_set(PyList_GET_ITEM(batch, i), s_decode_group, group) < 0)
            goto fail;
    return by_fill;
fail:
    Py_DECREF(by_fill);
    return NULL;
}

/* ---- Entry points: KVCacheManager's hot public methods as compiled functions --------------
 *
 * Entries(manager, fallbacks, template, no_hit, empty_batch) holds the manager's fixed objects
 * (its sequence and root dicts, the device pool's lists, the LRU) and the Python methods each
 * entry falls back to; the manager takes the entries' bound methods as its own open, reserve,
 * reserve_token_pairs, take_event_batch and free. Each entry runs the common case the way the
 * Python method does (the same compiled loops, the same order of effects) and hands any other
 * case, before changing anything, to the Python method: errors, keyword arguments, a cached
 * prefix, a member of the decode group, a budget, a swapped sequence, a step that evicts. One
 * Python frame less per call, and no attribute lookups on the manager but the two that change
 * (_group, the event lists). The manager and the entries form a cycle the GC collects. */
typedef struct {
    PyObject_HEAD
    PyObject *mgr, *seqs, *roots, *counters, *free, *refcount, *key_of, *pins, *lru; /* the manager's objects */
    PyObject *py_open, *py_reserve, *py_pairs, *py_take, *py_free;         /* the Python methods */
    PyObject *finish_step, *publish_full, *raise_if_bad;                   /* the manager's helpers */
    PyObject *template, *no_hit, *empty_batch, *block_size;
    Py_ssize_t bs;
    int keep_ids; /* prefix caching: token ids are kept and full blocks published */
} EntriesObject;

static PyObject *s_group, *s_event_kinds, *s_prefix_query_tokens, *s_members, *s_empty_salt;
static PyObject *no_members; /* an empty list, never mutated: _finish_step's `opened` when none is left */

#define ENTRY_FIELDS(X)                                                                                 \
    X(mgr) X(seqs) X(roots) X(counters) X(free) X(refcount) X(key_of) X(pins) X(lru) X(py_open) X(py_reserve)     \
    X(py_pairs) X(py_take) X(py_free) X(finish_step) X(publish_full) X(raise_if_bad) X(template)      \
    X(no_hit) X(empty_batch) X(block_size)

static int entries_traverse(EntriesObject *e, visitproc visit, void *arg)
{
#define VISIT(f) Py_VISIT(e->f);
    ENTRY_FIELDS(VISIT)
#undef VISIT
    return 0;
}

static int entries_clear(EntriesObject *e)
{
#define CLEAR(f) Py_CLEAR(e->f);
    ENTRY_FIELDS(CLEAR)
#undef CLEAR
    return 0;
}

static void entries_dealloc(EntriesObject *e)
{
    PyObject_GC_UnTrack(e);
    entries_clear(e);
    Py_TYPE(e)->tp_free((PyObject *)e);
}

/* Entries(manager, fallbacks, template, no_hit, empty_batch): fallbacks is the tuple of the
 * manager's Python open, reserve, reserve_token_pairs, take_event_batch and free (bound). */
static PyObject *entries_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *mgr, *fallbacks, *template, *no_hit, *empty_batch;
    if (!PyArg_ParseTuple(args, "OO!OOO", &mgr, &PyTuple_Type, &fallbacks, &template, &no_hit, &empty_batch))
        return NULL;
    if (PyTuple_GET_SIZE(fallbacks) != 5) {
        PyErr_SetString(PyExc_TypeError, "Entries: five fallbacks (open, reserve, reserve_token_pairs, "
                                         "take_event_batch, free)");
        return NULL;
    }
    EntriesObject *e = PyObject_GC_New(EntriesObject, type);
    if (e == NULL)
        return NULL;
#define NUL(f) e->f = NULL;
    ENTRY_FIELDS(NUL)
#undef NUL
    PyObject *device = NULL, *caching = NULL;
    e->mgr = Py_NewRef(mgr);
    e->py_open = Py_NewRef(PyTuple_GET_ITEM(fallbacks, 0));
    e->py_reserve = Py_NewRef(PyTuple_GET_ITEM(fallbacks, 1));
    e->py_pairs = Py_NewRef(PyTuple_GET_ITEM(fallbacks, 2));
    e->py_take = Py_NewRef(PyTuple_GET_ITEM(fallbacks, 3));
    e->py_free = Py_NewRef(PyTuple_GET_ITEM(fallbacks, 4));
    e->template = Py_NewRef(template);
    e->no_hit = Py_NewRef(no_hit);
    e->empty_batch = Py_NewRef(empty_batch);
    if (!(e->seqs = PyObject_GetAttrString(mgr, "seqs")) ||
        !(e->roots = PyObject_GetAttrString(mgr, "_roots")) ||
        !(e->counters = PyObject_GetAttrString(mgr, "counters")) ||
        !(e->block_size = PyObject_GetAttrString(mgr, "block_size")) ||
        !(e->finish_step = PyObject_GetAttrString(mgr, "_finish_step")) ||
        !(e->publish_full = PyObject_GetAttrString(mgr, "_publish_full")) ||
        !(caching = PyObject_GetAttrString(mgr, "enable_prefix_caching")) ||
        !(device = PyObject_GetAttrString(mgr, "device")) || !(e->free = PyObject_GetAttrString(device, "_free")) ||
        !(e->refcount = PyObject_GetAttrString(device, "refcount")) ||
        !(e->key_of = PyObject_GetAttrString(device, "key_of")) ||
        !(e->pins = PyObject_GetAttrString(device, "pins")) || !(e->lru = PyObject_GetAttrString(device, "_lru")) ||
        !(e->raise_if_bad = PyObject_GetAttrString(device, "_raise_if_bad")))
        goto fail;
    if (!PyDict_CheckExact(e->seqs) || !PyDict_CheckExact(e->roots) || !PyDict_Check(e->pins) ||
        !PyList_CheckExact(e->free) || !PyList_CheckExact(e->refcount) || !PyList_CheckExact(e->key_of) ||
        !IS_LRU(e->lru)) {
        PyErr_SetString(PyExc_TypeError, "Entries: a manager whose device pool has lists, dicts and the LRU");
        goto fail;
    }
    e->bs = PyLong_AsSsize_t(e->block_size);
    if (e->bs == -1 && PyErr_Occurred())
        goto fail;
    if (e->bs <= 0) {
        PyErr_SetString(PyExc_ValueError, "Entries: block_size must be positive");
        goto fail;
    }
    if ((e->keep_ids = PyObject_IsTrue(caching)) < 0)
        goto fail;
    Py_DECREF(caching);
    Py_DECREF(device);
    PyObject_GC_Track(e);
    return (PyObject *)e;
fail:
    Py_XDECREF(caching);
    Py_XDECREF(device);
    Py_DECREF(e);
    return NULL;
}

/* The manager's attribute `name` (a new reference), or NULL, no exception set, when it cannot be
 * read (the caller takes the Python path, which raises). A generic getattr: the manager's
 * instance dict is left alone (taking it would cost every Python-level attribute read on the
 * manager its inline-values fast path). */
static inline PyObject *mgr_attr(EntriesObject *e, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(e->mgr, name);
    if (v == NULL)
        PyErr_Clear();
    return v;
}

/* The Python method, with the call's own arguments. */
static PyObject *fallback(PyObject *method, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    return PyObject_Vectorcall(method, args, nargs, kwnames);
}

/* open(seq_id, token_ids): without prefix caching, a new empty sequence under the default
 * salt's root, as the Python open() makes it; anything else is the Python open(). */
static PyObject *entries_open(EntriesObject *e, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (nargs != 2 || kwnames != NULL || e->keep_ids || !PyList_CheckExact(args[1]))
        return fallback(e->py_open, args, nargs, kwnames);
    PyObject *seq_id = args[0];
    int known = PyDict_Contains(e->seqs, seq_id);
    PyObject *root = known ? NULL : PyDict_GetItemWithError(e->roots, s_empty_salt); /* borrowed */
    if (root == NULL) { /* a duplicate or unhashable id, or the root not made yet: Python's answer */
        PyErr_Clear();
        return fallback(e->py_open, args, nargs, kwnames);
    }
    Py_INCREF(root);
    PyObject *counters = e->counters, *queried = NULL, *sum = NULL, *seq = NULL, *result = NULL;
    PyObject *n = PyLong_FromSsize_t(PyList_GET_SIZE(args[1]));
    if (n == NULL || !(queried = PyObject_GetAttr(counters, s_prefix_query_tokens)) ||
        !(sum = PyNumber_Add(queried, n)))
        goto done;
    PyObject *ns_args[3] = {e->template, seq_id, root};
    if (!(seq = new_sequence(NULL, ns_args, 3)))
        goto done;
    if (PyObject_SetAttr(counters, s_prefix_query_tokens, sum) < 0)
        goto done;
    if (PyDict_SetItem(e->seqs, seq_id, seq) < 0)
        goto done;
    result = Py_NewRef(e->no_hit);
done:
    Py_DECREF(root);
    Py_XDECREF(n);
    Py_XDECREF(queried);
    Py_XDECREF(sum);
    Py_XDECREF(seq);
    return result;
}

/* reserve(seq_id, token_ids): the compiled prefill of an active sequence without a budget that
 * is not in the decode group, when it needs no copy and no eviction (then, with prefix caching,
 * the Python _publish_full of the blocks it filled); anything else is the Python reserve(). */
static PyObject *entries_reserve(EntriesObject *e, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (nargs != 2 || kwnames != NULL || !PyList_CheckExact(args[1]) || PyList_GET_SIZE(args[1]) == 0)
        return fallback(e->py_reserve, args, nargs, kwnames);
    PyObject *seq_id = args[0], *tokens = args[1];
    PyObject *seq = PyDict_GetItemWithError(e->seqs, seq_id); /* borrowed */
    if (seq == NULL) { /* an unknown or unhashable id: Python's answer */
        PyErr_Clear();
        return fallback(e->py_reserve, args, nargs, kwnames);
    }
    Py_INCREF(seq);
    PyObject *group = NULL, *members = NULL, *start = NULL, *result = NULL, *v;
    Py_ssize_t offset = slot_offset(seq, s_host_table_ID), offset2 = slot_offset(seq, s_budget_ID);
    if (offset < 0 || offset2 < 0 || (v = *(PyObject **)((char *)seq + offset)) != Py_None ||
        *(PyObject **)((char *)seq + offset2) != Py_None) { /* swapped, a budget, or not a plain Sequence */
        result = fallback(e->py_reserve, args, nargs, kwnames);
        goto done;
    }
    if (!(group = mgr_attr(e, s_group))) {
        result = fallback(e->py_reserve, args, nargs, kwnames);
        goto done;
    }
    if (group != Py_None) {
        if (!(members = PyObject_GetAttr(group, s_members)))
            goto done;
        int member = PySequence_Contains(members, seq_id);
        if (member < 0)
            goto done;
        if (member) { /* the group is dropped first: Python */
            result = fallback(e->py_reserve, args, nargs, kwnames);
            goto done;
        }
    }
    PyObject *pargs[6] = {seq, tokens, e->block_size, e->free, e->refcount, e->keep_ids ? Py_True : Py_False};
    if (!(start = prefill(NULL, pargs, 6)))
        goto done;
    if (start == Py_None) { /* a copy or an eviction: Python (nothing changed) */
        result = fallback(e->py_reserve, args, nargs, kwnames);
        goto done;
    }
    if (e->keep_ids) {
        Py_ssize_t first = PyLong_AsSsize_t(start), n = PyList_GET_SIZE(tokens);
        PyObject *intact = slot_get(seq, s_chain_intact);
        if (intact == NULL)
            goto done;
        int ok = PyObject_IsTrue(intact);
        Py_DECREF(intact);
        if (ok < 0)
            goto done;
        if (ok && (first + n) / e->bs > first / e->bs) {
            PyObject *r = PyObject_CallFunction(e->publish_full, "Onn", seq, first / e->bs, (first + n) / e->bs);
            if (r == NULL)
                goto done;
            Py_DECREF(r);
        }
    }
    result = Py_NewRef(start);
done:
    Py_DECREF(seq);
    Py_XDECREF(group);
    Py_XDECREF(members);
    Py_XDECREF(start);
    return result;
}

/* reserve_token_pairs(pairs): while a decode group holds, step_pairs() (then the Python
 * _finish_step when a member's open evicts or with prefix caching); anything else (no group,
 * pairs that do not fit it) is the Python reserve_token_pairs(). */
static PyObject *entries_pairs(EntriesObject *e, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (nargs != 1 || kwnames != NULL)
        return fallback(e->py_pairs, args, nargs, kwnames);
    PyObject *group = mgr_attr(e, s_group);
    if (group == NULL || group == Py_None) {
        Py_XDECREF(group);
        return fallback(e->py_pairs, args, nargs, kwnames);
    }
    PyObject *sargs[6] = {group, args[0], e->free, e->refcount, e->lru, e->keep_ids ? Py_True : Py_False};
    PyObject *left = step_pairs(NULL, sargs, 6), *result = NULL;
    if (left == NULL)
        goto done;
    if (left == Py_None) {
        result = fallback(e->py_pairs, args, nargs, kwnames);
        goto done;
    }
    if (PyObject_Length(left) > 0 || e->keep_ids) {
        PyObject *steps = slot_get(group, s_num_steps);
        if (steps == NULL)
            goto done;
        PyObject *fargs[3] = {group, steps, PyList_Check(left) ? left : no_members};
        PyObject *r = PyObject_Vectorcall(e->finish_step, fargs, 3, NULL);
        Py_DECREF(steps);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
    }
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(group);
    Py_XDECREF(left);
    return result;
}

/* take_event_batch(): the shared empty batch when nothing was recorded; else the Python one. */
static PyObject *entries_take(EntriesObject *e, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (nargs == 0 && kwnames == NULL) {
        PyObject *kinds = mgr_attr(e, s_event_kinds);
        int empty = kinds != NULL && PyList_CheckExact(kinds) && PyList_GET_SIZE(kinds) == 0;
        Py_XDECREF(kinds);
        if (empty)
            return Py_NewRef(e->empty_batch);
    }
    return fallback(e->py_take, args, nargs, kwnames);
}

/* free(seq_id): while no decode group holds, an active sequence leaves and its table is
 * released tail first (an over-released block: the pool's IntegrityError, the sequence gone, as
 * in Python); anything else is the Python free(). */
static PyObject *entries_free(EntriesObject *e, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (nargs != 1 || kwnames != NULL)
        return fallback(e->py_free, args, nargs, kwnames);
    PyObject *group = mgr_attr(e, s_group);
    int grouped = group != Py_None;
    Py_XDECREF(group);
    PyObject *seq = grouped ? NULL : PyDict_GetItemWithError(e->seqs, args[0]); /* borrowed */
    if (seq == NULL) { /* a group to drop, an unknown or unhashable id: Python's answer */
        PyErr_Clear();
        return fallback(e->py_free, args, nargs, kwnames);
    }
    Py_ssize_t offset = slot_offset(seq, s_host_table_ID), toffset = slot_offset(seq, s_table_ID);
    PyObject *table = toffset >= 0 ? *(PyObject **)((char *)seq + toffset) : NULL;
    if (offset < 0 || *(PyObject **)((char *)seq + offset) != Py_None || table == NULL)
        return fallback(e->py_free, args, nargs, kwnames); /* swapped, or not a plain Sequence */
    Py_INCREF(table);
    PyObject *result = NULL;
    if (PyDict_DelItem(e->seqs, args[0]) == 0) {
        PyObject *rargs[7] = {table, Py_True, e->refcount, e->key_of, e->pins, e->free, e->lru};
        PyObject *bad = release(NULL, rargs, 7);
        if (bad == Py_None) {
            result = bad;
        } else if (bad != NULL) {
            result = PyObject_CallOneArg(e->raise_if_bad, bad);
            Py_DECREF(bad);
        }
    }
    Py_DECREF(table);
    return result;
}

static PyMethodDef entries_methods[] = {
    {"open", (PyCFunction)(void (*)(void))entries_open, METH_FASTCALL | METH_KEYWORDS,
     "KVCacheManager.open(); see block_core.c."},
    {"reserve", (PyCFunction)(void (*)(void))entries_reserve, METH_FASTCALL | METH_KEYWORDS,
     "KVCacheManager.reserve(); see block_core.c."},
    {"reserve_token_pairs", (PyCFunction)(void (*)(void))entries_pairs, METH_FASTCALL | METH_KEYWORDS,
     "KVCacheManager.reserve_token_pairs(); see block_core.c."},
    {"take_event_batch", (PyCFunction)(void (*)(void))entries_take, METH_FASTCALL | METH_KEYWORDS,
     "KVCacheManager.take_event_batch(); see block_core.c."},
    {"free", (PyCFunction)(void (*)(void))entries_free, METH_FASTCALL | METH_KEYWORDS,
     "KVCacheManager.free(); see block_core.c."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EntriesType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_block_core.Entries",
    .tp_basicsize = sizeof(EntriesObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A KVCacheManager's compiled entry points; see block_core.c.",
    .tp_new = entries_new,
    .tp_dealloc = (destructor)entries_dealloc,
    .tp_traverse = (traverseproc)entries_traverse,
    .tp_clear = (inquiry)entries_clear,
    .tp_methods = entries_methods,
};

static PyMethodDef methods[] = {
    {"split_pairs", split_pairs, METH_O, "zip(*pairs) for (seq_id, token) 2-tuples; see block_core.c."},
    {"new_sequence", (PyCFunction)(void (*)(void))new_sequence, METH_FASTCALL,
     "Sequence(seq_id, root, [], [], [], []) as a copy of a template; see block_core.c."},
    {"group_fills", group_fills, METH_VARARGS, "A new decode group's schedule; see block_core.c."},
    {"finish_step", finish_step, METH_VARARGS, "KVCacheManager._finish_step without a host tier; see block_core.c."},
    {"set_chain", set_chain, METH_O, "Give the address of pagedkv_chain_keys; see block_core.c."},
    {"block_key", block_key, METH_VARARGS, "One block's key by the compiled chain; see block_core.c."},
    {"open_block", open_block, METH_VARARGS, "KVCacheManager._open_block() without a host tier; see block_core.c."},
    {"prefill", (PyCFunction)(void (*)(void))prefill, METH_FASTCALL,
     "KVCacheManager.reserve() without eviction or copy; see block_core.c."},
    {"take", take, METH_VARARGS, "BlockPool.take(n) with LRU eviction; see block_core.c."},
    {"release", (PyCFunction)(void (*)(void))release, METH_FASTCALL,
     "BlockPool.free(blocks) with the LRU policy; see block_core.c."},
    {"step", step, METH_VARARGS, "A decode group's step without eviction or publishing; see block_core.c."},
    {"step_pairs", (PyCFunction)(void (*)(void))step_pairs, METH_FASTCALL,
     "A decode group's step for (seq_id, token) pairs; see block_core.c."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_block_core", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__block_core(void)
{
    for (int i = 0; i < NUM_NAMES; i++)
        if ((names[i] = PyUnicode_InternFromString(name_text[i])) == NULL)
            return NULL;
    zero_float = PyFloat_FromDouble(0.0);
    one_long = PyLong_FromLong(1);
    zero_long = PyLong_FromLong(0);
    if (!zero_float || !one_long || !zero_long)
        return NULL;
    s_group = PyUnicode_InternFromString("_group");
    s_event_kinds = PyUnicode_InternFromString("_event_kinds");
    s_prefix_query_tokens = PyUnicode_InternFromString("prefix_query_tokens");
    s_members = PyUnicode_InternFromString("members");
    s_empty_salt = PyBytes_FromStringAndSize("", 0);
    no_members = PyList_New(0);
    if (!s_group || !s_event_kinds || !s_prefix_query_tokens || !s_members || !s_empty_salt ||
        !no_members)
        return NULL;
    if (PyType_Ready(&LRUType) < 0 || PyType_Ready(&LRUIterType) < 0 || PyType_Ready(&EntriesType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "ABI_VERSION", ABI_VERSION) < 0 ||
        PyModule_AddObjectRef(m, "LRU", (PyObject *)&LRUType) < 0 ||
        PyModule_AddObjectRef(m, "Entries", (PyObject *)&EntriesType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
