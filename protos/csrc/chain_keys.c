/* Chained block keys (protos/keys.py) in C: blake2b-128 written from RFC 7693.
 *
 * key[i] = BLAKE2b(digest 16 bytes, no key; parent || tokens of block i as little-endian int64),
 * parent = key[i - 1] (the caller's `parent` for i = 0). Every block of a prompt in one call, so
 * the Python side pays one foreign call per prompt instead of four hashlib calls per block.
 *
 * The message of a key is 16 + 8 * block_size bytes; as 64-bit little-endian words it is
 * [parent_lo, parent_hi, token_0, token_1, ...], so words are loaded straight from the inputs
 * and no concatenated copy is built. Plain C99, no state outside a call.
 *
 * Two entry points. pagedkv_chain_keys reads packed token bytes (numpy arrays; any caller).
 * pagedkv_chain_keys_list reads a Python list of ints and returns a list of 16-byte keys
 * itself: packing the ints (struct.pack) and splitting the keys took as long as hashing them.
 * It is loaded with ctypes.PyDLL (the GIL held) and uses only the stable-ABI functions
 * declared below, resolved against the running interpreter as an extension module's are, so
 * it builds without Python's headers (CI installs only gcc).
 */

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

/* Python's stable ABI (PEP 384): opaque objects, functions only. */
typedef struct _object PyObject;
extern PyObject *PyList_GetItem(PyObject *list, ssize_t index); /* borrowed; NULL + IndexError */
extern long long PyLong_AsLongLong(PyObject *obj);              /* -1 + an exception on failure */
extern PyObject *PyErr_Occurred(void);
extern PyObject *PyErr_NoMemory(void);
extern PyObject *PyList_New(ssize_t size);
extern int PyList_SetItem(PyObject *list, ssize_t index, PyObject *item); /* steals item */
extern PyObject *PyBytes_FromStringAndSize(const char *bytes, ssize_t size);
extern void Py_DecRef(PyObject *obj);

#define KEY_BYTES 16
#define BLOCK_WORDS 16 /* a compression takes 128 bytes */

/* RFC 7693 section 2.6: the initialization vector (the SHA-512 IV). */
static const uint64_t IV[8] = {
    0x6A09E667F3BCC908ULL, 0xBB67AE8584CAA73BULL, 0x3C6EF372FE94F82BULL, 0xA54FF53A5F1D36F1ULL,
    0x510E527FADE682D1ULL, 0x9B05688C2B3E6C1FULL, 0x1F83D9ABFB41BD6BULL, 0x5BE0CD19137E2179ULL,
};

/* RFC 7693 section 2.7: message word schedule; rounds 10 and 11 reuse rows 0 and 1. */
static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t rotr64(uint64_t x, unsigned n) { return (x >> n) | (x << (64 - n)); }

/* Byte-wise, so the result is the same on any host byte order; compilers fuse it to one load. */
static inline uint64_t load64_le(const uint8_t *p) {
    return (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24 |
           (uint64_t)p[4] << 32 | (uint64_t)p[5] << 40 | (uint64_t)p[6] << 48 | (uint64_t)p[7] << 56;
}

static inline void store64_le(uint8_t *p, uint64_t x) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(x >> (8 * i));
}

/* RFC 7693 section 3.1: the mixing function G. */
#define G(a, b, c, d, x, y)           \
    do {                              \
        a = a + b + (x);              \
        d = rotr64(d ^ a, 32);        \
        c = c + d;                    \
        b = rotr64(b ^ c, 24);        \
        a = a + b + (y);              \
        d = rotr64(d ^ a, 16);        \
        c = c + d;                    \
        b = rotr64(b ^ c, 63);        \
    } while (0)

/* RFC 7693 section 3.2: one round of F, the columns then the diagonals. */
#define ROUND(r)                                                           \
    do {                                                                   \
        G(v[0], v[4], v[8], v[12], m[SIGMA[r][0]], m[SIGMA[r][1]]);        \
        G(v[1], v[5], v[9], v[13], m[SIGMA[r][2]], m[SIGMA[r][3]]);        \
        G(v[2], v[6], v[10], v[14], m[SIGMA[r][4]], m[SIGMA[r][5]]);       \
        G(v[3], v[7], v[11], v[15], m[SIGMA[r][6]], m[SIGMA[r][7]]);       \
        G(v[0], v[5], v[10], v[15], m[SIGMA[r][8]], m[SIGMA[r][9]]);       \
        G(v[1], v[6], v[11], v[12], m[SIGMA[r][10]], m[SIGMA[r][11]]);     \
        G(v[2], v[7], v[8], v[13], m[SIGMA[r][12]], m[SIGMA[r][13]]);      \
        G(v[3], v[4], v[9], v[14], m[SIGMA[r][14]], m[SIGMA[r][15]]);      \
    } while (0)

/* RFC 7693 section 3.2: the compression function F. `bytes_so_far` is the offset counter t
 * (messages here are far below 2^64 bytes, so its high word is 0). */
static void compress(uint64_t h[8], const uint64_t m[BLOCK_WORDS], uint64_t bytes_so_far, int is_last) {
    uint64_t v[16];
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= bytes_so_far;
    if (is_last) v[14] = ~v[14];
    /* Unrolled with constant schedule rows: the message words stay in registers. */
    ROUND(0); ROUND(1); ROUND(2); ROUND(3); ROUND(4); ROUND(5);
    ROUND(6); ROUND(7); ROUND(8); ROUND(9); ROUND(10); ROUND(11);
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* One key: BLAKE2b-128 of the words parent[0..1] || tokens[0..block_size). The message is fed
 * 16 words at a time; the last block is zero-padded and flagged (RFC 7693 section 3.3). */
static void block_key(const uint64_t parent[2], const uint8_t *tokens, int64_t block_size, uint64_t out[2]) {
    uint64_t h[8];
    uint64_t m[BLOCK_WORDS];
    for (int i = 0; i < 8; i++) h[i] = IV[i];
    h[0] ^= 0x01010000ULL ^ KEY_BYTES; /* parameter block: digest length 16, no key, fanout 1, depth 1 */
    const int64_t num_words = 2 + block_size;
    int64_t word = 0; /* message words consumed so far */
    while (1) {
        int64_t n = num_words - word < BLOCK_WORDS ? num_words - word : BLOCK_WORDS;
        for (int64_t j = 0; j < n; j++) {
            int64_t w = word + j;
            m[j] = w < 2 ? parent[w] : load64_le(tokens + 8 * (w - 2));
        }
        for (int64_t j = n; j < BLOCK_WORDS; j++) m[j] = 0;
        word += n;
        int is_last = word == num_words;
        compress(h, m, (uint64_t)word * 8, is_last);
        if (is_last) break;
    }
    out[0] = h[0];
    out[1] = h[1];
}

/* The interface version the loader checks (bump on any signature change). */
int64_t pagedkv_keys_abi_version(void) { return 2; }

/* Keys of `num_blocks` consecutive blocks. `tokens` holds num_blocks * block_size int64 token
 * ids, little-endian; `parent` is the 16-byte key before the first block; `out` receives
 * num_blocks * 16 bytes. Returns 0, or -1 (writing nothing) on a non-positive block size. */
int64_t pagedkv_chain_keys(const uint8_t *parent, const uint8_t *tokens, int64_t block_size,
                           int64_t num_blocks, uint8_t *out) {
    if (block_size <= 0 || num_blocks < 0) return -1;
    uint64_t key[2] = {load64_le(parent), load64_le(parent + 8)};
    for (int64_t i = 0; i < num_blocks; i++) {
        block_key(key, tokens + 8 * block_size * i, block_size, key);
        store64_le(out + KEY_BYTES * i, key[0]);
        store64_le(out + KEY_BYTES * i + 8, key[1]);
    }
    return 0;
}

/* Keys of `num_blocks` blocks of the Python list `tokens`, starting at index `first`: a new list
 * of num_blocks bytes objects, or NULL with a Python exception set (an item that is not an int
 * in the int64 range, the list shrinking under us, no memory). The caller checked the sizes. */
PyObject *pagedkv_chain_keys_list(const uint8_t *parent, PyObject *tokens, int64_t first,
                                  int64_t block_size, int64_t num_blocks) {
    int64_t num_tokens = block_size * num_blocks;
    uint8_t *packed = malloc(8 * (size_t)num_tokens + KEY_BYTES * (size_t)num_blocks);
    if (packed == NULL) return PyErr_NoMemory();
    uint8_t *keys = packed + 8 * num_tokens;
    for (int64_t i = 0; i < num_tokens; i++) {
        PyObject *item = PyList_GetItem(tokens, (ssize_t)(first + i));
        long long value = item == NULL ? -1 : PyLong_AsLongLong(item);
        if (value == -1 && PyErr_Occurred() != NULL) {
            free(packed);
            return NULL;
        }
        store64_le(packed + 8 * i, (uint64_t)value);
    }
    pagedkv_chain_keys(parent, packed, block_size, num_blocks, keys);
    PyObject *out = PyList_New((ssize_t)num_blocks);
    for (int64_t i = 0; out != NULL && i < num_blocks; i++) {
        PyObject *key = PyBytes_FromStringAndSize((const char *)keys + KEY_BYTES * i, KEY_BYTES);
        if (key == NULL) {
            Py_DecRef(out);
            out = NULL;
        } else {
            PyList_SetItem(out, (ssize_t)i, key);
        }
    }
    free(packed);
    return out;
}
