/* Linked-list eviction orders (order.h): LRU, and SLRU (two LRU segments and a ghost list).
 *
 * A segment is a doubly linked list over block ids held in arrays: add, unlink and the oldest
 * are a few array reads, where an OrderedDict pays two hash lookups each. SLRU keeps what
 * eviction.py's reference SLRU keeps (a hit flag per block, probation and protected segments,
 * the last num_blocks evicted keys, oldest first) and makes the same decisions in the same
 * order, so the compiled and the Python policy evict the same blocks.
 */
#include "order.h" /* Python.h first: it sets the feature macros */

#include <string.h>

typedef struct {
    int32_t head, tail; /* -1 when empty */
    Py_ssize_t count;
} Chain;

typedef struct {
    Order base;
    Py_ssize_t cap;       /* size of prev, next, seg */
    int32_t *prev, *next; /* neighbours within the block's segment, -1 at the ends */
    uint8_t *seg;         /* 0: not listed, else 1 + the index of its segment in chain[] */
    Chain chain[2];       /* LRU: chain[0]. SLRU: probation, protected */
    /* SLRU only */
    uint8_t *is_hit; /* hit since it last entered the evictable set; num_hit entries */
    Py_ssize_t num_hit;
    double share;      /* protected holds at most share * evictable blocks */
    /* The ghost list: recently evicted keys, oldest first, in ghost[head:tail] (NULL where a key
     * came back since), and where each is in that array. The reference's OrderedDict, without a
     * method call and a tuple per eviction. */
    PyObject **ghost;
    Py_ssize_t head, tail, ghost_cap;
    PyObject *ghost_at; /* dict: key -> its index in ghost */
    Py_ssize_t ghost_size;
} ListOrder;

enum { PROBATION = 0, PROTECTED = 1 };

/* ---- SLRU's ghost list ---- */

/* 1 when the ghost list held key (it no longer does), 0 when not, -1 on error. */
static int ghost_take(ListOrder *l, PyObject *key)
{
    PyObject *at = PyDict_GetItemWithError(l->ghost_at, key); /* borrowed */
    if (at == NULL)
        return PyErr_Occurred() ? -1 : 0;
    Py_ssize_t i = PyLong_AsSsize_t(at);
    if (PyDict_DelItem(l->ghost_at, key) < 0)
        return -1;
    Py_CLEAR(l->ghost[i]);
    return 1;
}

/* Room at the tail: the live keys move to the front (and the array doubles when they fill half). */
static int ghost_compact(ListOrder *l)
{
    Py_ssize_t j = 0;
    for (Py_ssize_t i = l->head; i < l->tail; i++) {
        PyObject *key = l->ghost[i];
        if (key == NULL)
            continue;
        l->ghost[i] = NULL;
        l->ghost[j] = key;
        PyObject *at = PyLong_FromSsize_t(j++);
        int r = at == NULL ? -1 : PyDict_SetItem(l->ghost_at, key, at);
        Py_XDECREF(at);
        if (r < 0)
            return -1;
    }
    l->head = 0;
    l->tail = j;
    if (2 * j >= l->ghost_cap) {
        Py_ssize_t cap = l->ghost_cap ? 2 * l->ghost_cap : 64;
        PyObject **ghost = PyMem_Realloc(l->ghost, cap * sizeof(PyObject *));
        if (ghost == NULL)
            return PyErr_NoMemory(), -1;
        memset(ghost + l->ghost_cap, 0, (cap - l->ghost_cap) * sizeof(PyObject *));
        l->ghost = ghost;
        l->ghost_cap = cap;
    }
    return 0;
}

/* Remember an evicted key (one already remembered keeps its place); the oldest is forgotten
 * beyond ghost_size keys. 0, or -1 on error. */
static int ghost_put(ListOrder *l, PyObject *key)
{
    int known = PyDict_Contains(l->ghost_at, key);
    if (known != 0)
        return known < 0 ? -1 : 0;
    if (l->tail == l->ghost_cap && ghost_compact(l) < 0)
        return -1;
    PyObject *at = PyLong_FromSsize_t(l->tail);
    int r = at == NULL ? -1 : PyDict_SetItem(l->ghost_at, key, at);
    Py_XDECREF(at);
    if (r < 0)
        return -1;
    l->ghost[l->tail++] = Py_NewRef(key);
    if (PyDict_Size(l->ghost_at) > l->ghost_size) { /* the oldest is forgotten */
        while (l->ghost[l->head] == NULL)
            l->head++;
        PyObject *oldest = l->ghost[l->head];
        l->ghost[l->head++] = NULL;
        r = PyDict_DelItem(l->ghost_at, oldest);
        Py_DECREF(oldest);
        return r;
    }
    return 0;
}

static int grow(ListOrder *l, Py_ssize_t need)
{
    if (need <= l->cap)
        return 0;
    Py_ssize_t cap = l->cap ? l->cap : 64;
    while (cap < need)
        cap *= 2;
    int32_t *prev = PyMem_Realloc(l->prev, cap * sizeof(int32_t));
    if (prev == NULL)
        return PyErr_NoMemory(), -1;
    l->prev = prev;
    int32_t *next = PyMem_Realloc(l->next, cap * sizeof(int32_t));
    if (next == NULL)
        return PyErr_NoMemory(), -1;
    l->next = next;
    uint8_t *seg = PyMem_Realloc(l->seg, cap);
    if (seg == NULL)
        return PyErr_NoMemory(), -1;
    memset(seg + l->cap, 0, cap - l->cap);
    l->seg = seg;
    l->cap = cap;
    return 0;
}

/* Append b (not listed, b < cap) at the young end of segment s. */
static inline void push(ListOrder *l, int s, Py_ssize_t b)
{
    Chain *c = &l->chain[s];
    l->seg[b] = (uint8_t)(s + 1);
    l->prev[b] = c->tail;
    l->next[b] = -1;
    if (c->tail >= 0)
        l->next[c->tail] = (int32_t)b;
    else
        c->head = (int32_t)b;
    c->tail = (int32_t)b;
    c->count++;
    l->base.count++;
}

/* Unlink b (listed) from its segment. */
static inline void unlink_block(ListOrder *l, Py_ssize_t b)
{
    Chain *c = &l->chain[l->seg[b] - 1];
    int32_t p = l->prev[b], n = l->next[b];
    if (p >= 0)
        l->next[p] = n;
    else
        c->head = n;
    if (n >= 0)
        l->prev[n] = p;
    else
        c->tail = p;
    l->seg[b] = 0;
    c->count--;
    l->base.count--;
}

static int list_has(const Order *o, Py_ssize_t b)
{
    const ListOrder *l = (const ListOrder *)o;
    return b < l->cap && l->seg[b];
}

static void list_remove(Order *o, Py_ssize_t b) { unlink_block((ListOrder *)o, b); }

static int no_touch(Order *o, Py_ssize_t b) { return 0; }

static void no_forget(Order *o, Py_ssize_t b) {}

static PyObject *list_victims(Order *o)
{
    ListOrder *l = (ListOrder *)o;
    PyObject *out = PyList_New(o->count);
    if (out == NULL)
        return NULL;
    Py_ssize_t j = 0;
    for (int s = 0; s < 2; s++)
        for (int32_t b = l->chain[s].head; b >= 0; b = l->next[b]) {
            PyObject *v = PyLong_FromLong(b);
            if (v == NULL) {
                Py_DECREF(out);
                return NULL;
            }
            PyList_SET_ITEM(out, j++, v);
        }
    return out;
}

/* ---- LRU: least recently released first ---- */

static int lru_add(Order *o, Py_ssize_t b)
{
    ListOrder *l = (ListOrder *)o;
    if (grow(l, b + 1) < 0)
        return -1;
    push(l, 0, b);
    return 0;
}

static Py_ssize_t lru_pop(Order *o)
{
    ListOrder *l = (ListOrder *)o;
    Py_ssize_t b = l->chain[0].head;
    unlink_block(l, b);
    return b;
}

static const OrderOps lru_ops = {lru_add, list_remove, lru_pop, list_has, no_touch, no_forget, list_victims};

/* ---- SLRU: hit blocks and returning keys are protected, the rest pass through probation ---- */

static int slru_add(Order *o, Py_ssize_t b)
{
    ListOrder *l = (ListOrder *)o;
    if (grow(l, b + 1) < 0)
        return -1;
    if (b < l->num_hit && l->is_hit[b]) {
        push(l, PROTECTED, b);
        return 0;
    }
    PyObject *key = pkv_order_key(o, b);
    int known = key != Py_None && PyDict_Size(l->ghost_at) ? ghost_take(l, key) : 0;
    if (known < 0)
        return -1;
    push(l, known ? PROTECTED : PROBATION, b); /* evicted recently and back: protected */
    return 0;
}

static Py_ssize_t slru_pop(Order *o)
{
    ListOrder *l = (ListOrder *)o;
    Chain *probation = &l->chain[PROBATION], *protected = &l->chain[PROTECTED];
    double limit = l->share * (double)(probation->count + protected->count);
    while ((double)protected->count > limit) { /* demote: it must earn protection again */
        Py_ssize_t b = protected->head;
        unlink_block(l, b);
        if (b < l->num_hit)
            l->is_hit[b] = 0;
        push(l, PROBATION, b);
    }
    Py_ssize_t b = probation->count ? probation->head : protected->head;
    unlink_block(l, b);
    PyObject *key = pkv_order_key(o, b);
    if (key != Py_None && l->ghost_size && ghost_put(l, key) < 0)
        return -1;
    return b;
}

static int slru_touch(Order *o, Py_ssize_t b)
{
    ListOrder *l = (ListOrder *)o;
    if (b < l->num_hit)
        l->is_hit[b] = 1;
    return 0;
}

static void slru_forget(Order *o, Py_ssize_t b)
{
    ListOrder *l = (ListOrder *)o;
    if (b < l->num_hit)
        l->is_hit[b] = 0;
}

static const OrderOps slru_ops = {slru_add, list_remove, slru_pop, list_has, slru_touch, slru_forget, list_victims};

/* ---- the types ---- */

static ListOrder *list_alloc(PyTypeObject *type, const OrderOps *ops)
{
    ListOrder *l = (ListOrder *)type->tp_alloc(type, 0); /* zeroed */
    if (l == NULL)
        return NULL;
    l->base.ops = ops;
    for (int s = 0; s < 2; s++)
        l->chain[s].head = l->chain[s].tail = -1;
    return l;
}

static PyObject *lru_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"num_blocks", NULL};
    Py_ssize_t num_blocks = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|n:LRUOrder", kwlist, &num_blocks))
        return NULL;
    ListOrder *l = list_alloc(type, &lru_ops);
    if (l != NULL && num_blocks > 0 && grow(l, num_blocks) < 0)
        Py_CLEAR(l);
    return (PyObject *)l;
}

static PyObject *slru_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"num_blocks", "protected_share", NULL};
    Py_ssize_t num_blocks;
    double share = 0.5;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n|d:SLRUOrder", kwlist, &num_blocks, &share))
        return NULL;
    if (num_blocks < 0 || num_blocks > PKV_MAX_BLOCKS || !(share >= 0.0 && share <= 1.0)) {
        PyErr_Format(PyExc_ValueError, "SLRUOrder needs 0 <= num_blocks and 0 <= protected_share <= 1");
        return NULL;
    }
    ListOrder *l = list_alloc(type, &slru_ops);
    if (l == NULL)
        return NULL;
    l->share = share;
    l->num_hit = l->ghost_size = num_blocks;
    l->is_hit = PyMem_Calloc(num_blocks ? num_blocks : 1, 1);
    l->ghost_at = PyDict_New();
    if (l->is_hit == NULL || l->ghost_at == NULL || grow(l, num_blocks) < 0) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        Py_DECREF(l);
        return NULL;
    }
    return (PyObject *)l;
}

static PyObject *slru_segment_of(ListOrder *l, PyObject *arg)
{
    Py_ssize_t b = pkv_block_arg(arg);
    if (b < 0)
        return NULL;
    if (!list_has(&l->base, b))
        Py_RETURN_NONE;
    return PyUnicode_FromString(l->seg[b] - 1 == PROBATION ? "probation" : "protected");
}

static int list_traverse(ListOrder *l, visitproc visit, void *arg)
{
    Py_VISIT(l->ghost_at);
    return pkv_order_traverse(&l->base, visit, arg);
}

static int list_clear(ListOrder *l)
{
    Py_CLEAR(l->ghost_at);
    for (Py_ssize_t i = l->head; i < l->tail; i++)
        Py_CLEAR(l->ghost[i]);
    l->head = l->tail = 0;
    return pkv_order_clear(&l->base);
}

static void list_dealloc(ListOrder *l)
{
    PyObject_GC_UnTrack(l);
    list_clear(l);
    PyMem_Free(l->prev);
    PyMem_Free(l->next);
    PyMem_Free(l->seg);
    PyMem_Free(l->is_hit);
    PyMem_Free(l->ghost);
    Py_TYPE(l)->tp_free((PyObject *)l);
}

PyTypeObject pkv_LRUOrderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_block_core.LRUOrder",
    .tp_basicsize = sizeof(ListOrder),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "LRUOrder(num_blocks=0): least recently released first.",
    .tp_base = &pkv_OrderType,
    .tp_new = lru_new,
    .tp_dealloc = (destructor)list_dealloc,
    .tp_traverse = (traverseproc)list_traverse,
    .tp_clear = (inquiry)list_clear,
};

static PyMethodDef slru_methods[] = {
    {"segment_of", (PyCFunction)slru_segment_of, METH_O,
     "segment_of(block) -> 'probation', 'protected', or None when not evictable."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject pkv_SLRUOrderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_block_core.SLRUOrder",
    .tp_basicsize = sizeof(ListOrder),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "SLRUOrder(num_blocks, protected_share=0.5): segmented LRU with a ghost list.",
    .tp_base = &pkv_OrderType,
    .tp_methods = slru_methods,
    .tp_new = slru_new,
    .tp_dealloc = (destructor)list_dealloc,
    .tp_traverse = (traverseproc)list_traverse,
    .tp_clear = (inquiry)list_clear,
};
