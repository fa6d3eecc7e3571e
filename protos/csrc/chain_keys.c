/* Chained block keys (protos/keys.py) in C: SHA-256 truncated to 128 bits, computed by the
 * libcrypto that Python's hashlib already loaded (the loader passes SHA256_Init / _Update /
 * _Final in: no OpenSSL headers, no link-time dependency). OpenSSL's SHA-256 uses the CPU's SHA
 * extensions where they exist (SHA-NI on AMD Zen and recent Intel): 72 keys take ~11 us, against
 * ~98 us for a portable scalar BLAKE2b here, which this file held before.
 *
 * key[i] = SHA-256(parent || tokens of block i as little-endian int64)[0:16], parent = key[i - 1]
 * (the caller's `parent` for i = 0). Every block of a prompt in one call, so the Python side pays
 * one foreign call per prompt instead of four hashlib calls per block. The parent and the block's
 * tokens are fed as two updates: no concatenated copy is built.
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

static inline void store64_le(uint8_t *p, uint64_t x) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(x >> (8 * i));
}

/* libcrypto's low-level SHA-256 (OpenSSL 1.1 and 3.x export it; its one-shot SHA256() goes
 * through an EVP fetch per call in 3.x, ~1.5 us). The context is opaque here: SHA256_CTX is 112
 * bytes in those versions, so 256 aligned bytes hold it; the loader checks a key against
 * hashlib before using this library at all. */
typedef int (*sha256_init_fn)(void *ctx);
typedef int (*sha256_update_fn)(void *ctx, const void *data, size_t len);
typedef int (*sha256_final_fn)(unsigned char *md, void *ctx);
static sha256_init_fn sha256_init = NULL;
static sha256_update_fn sha256_update = NULL;
static sha256_final_fn sha256_final = NULL;
typedef union {
    unsigned char bytes[256];
    uint64_t align;
} sha256_ctx;

/* Give the library libcrypto's SHA256_Init, SHA256_Update and SHA256_Final. */
void pagedkv_keys_set_sha256(void *init, void *update, void *final) {
    sha256_init = (sha256_init_fn)init;
    sha256_update = (sha256_update_fn)update;
    sha256_final = (sha256_final_fn)final;
}

/* One key: the first 16 bytes of SHA-256(parent || tokens[0..block_size) as int64 LE). */
static void block_key(const uint8_t *parent, const uint8_t *tokens, int64_t block_size, uint8_t *out) {
    sha256_ctx ctx;
    unsigned char digest[32];
    sha256_init(&ctx);
    sha256_update(&ctx, parent, KEY_BYTES);
    sha256_update(&ctx, tokens, 8 * (size_t)block_size);
    sha256_final(digest, &ctx);
    memcpy(out, digest, KEY_BYTES);
}

/* The interface version the loader checks (bump on any signature change). */
int64_t pagedkv_keys_abi_version(void) { return 3; }

/* Keys of `num_blocks` consecutive blocks. `tokens` holds num_blocks * block_size int64 token
 * ids, little-endian; `parent` is the 16-byte key before the first block; `out` receives
 * num_blocks * 16 bytes. Returns 0, or -1 (writing nothing) on a non-positive block size or
 * before pagedkv_keys_set_sha256. */
int64_t pagedkv_chain_keys(const uint8_t *parent, const uint8_t *tokens, int64_t block_size,
                           int64_t num_blocks, uint8_t *out) {
    if (block_size <= 0 || num_blocks < 0 || sha256_init == NULL) return -1;
    for (int64_t i = 0; i < num_blocks; i++) {
        block_key(parent, tokens + 8 * block_size * i, block_size, out + KEY_BYTES * i);
        parent = out + KEY_BYTES * i;
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
