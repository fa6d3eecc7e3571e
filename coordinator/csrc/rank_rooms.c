/* The shortlist's ranking of a room index snapshot (coordinator/room_index.py) in one pass.
 *
 * The numpy ranking takes ~40 array operations an open (~100 us at 1,000 nodes, most of it
 * per-call overhead); this computes every eligible row's rank head in the same IEEE double
 * operations, in the same order, and keeps the `want` smallest in a small sorted buffer: ~5 us.
 * Built without -ffast-math and with -ffp-contract=off, so no multiply-add is fused and the
 * floats, and therefore the choice, are those of the numpy ranking (a property test checks).
 *
 * A row's key is (over, scan position or 0, cost, tie position or 0), compared in that order:
 *   room = free + evictable; the row is eligible when need <= room
 *   load = active if active >= 0 else total - room
 *   cost = c0 + lw * (load + need)
 *   fair = (s1 * total) / sum_total (0 when sum_total is 0)
 *   opens = opens_scaled / opens_scale + 1
 *   over = opens > k1 * fair + margin [and, when both, opens > k2 * fair + m2]
 * Without tie positions the caller settles rows of equal keys by rendezvous rank itself.
 *
 * Both orders (plain and scan) come from one pass: the divisions are done once a row.
 *
 * out, per order: [0] rows strictly before the cut (nb), [1] rows at the cut (nt), [2] sum of
 * total, then `want` slots of those nb rows in key order, `want` slots of their group numbers
 * (rows of one group share a key), then the nt rows whose key equals the want-th smallest.
 * No Python objects: the arrays belong to the caller's snapshot.
 */

#include <stdint.h>
#include <stdlib.h>

#define ABI_VERSION 1
#define MAX_WANT 64

int64_t pagedkv_rank_abi_version(void) { return ABI_VERSION; }

typedef struct {
    int64_t over, scan;
    double cost;
    int64_t tie, row;
} rank_key;

static int key_less(const rank_key *a, const rank_key *b) {
    if (a->over != b->over) return a->over < b->over;
    if (a->scan != b->scan) return a->scan < b->scan;
    if (a->cost != b->cost) return a->cost < b->cost;
    return a->tie < b->tie;
}

static int key_same(const rank_key *a, const rank_key *b) {
    return a->over == b->over && a->scan == b->scan && a->cost == b->cost && a->tie == b->tie;
}

/* One order's best rows so far: the want smallest keys, sorted. */
typedef struct {
    rank_key buf[MAX_WANT];
    int64_t kept;
} best_rows;

static void offer(best_rows *b, const rank_key *k, int64_t want) {
    if (b->kept == want && !key_less(k, &b->buf[want - 1])) return;
    int64_t j = b->kept < want ? b->kept++ : want - 1;
    for (; j > 0 && key_less(k, &b->buf[j - 1]); j--) b->buf[j] = b->buf[j - 1];
    b->buf[j] = *k;
}

/* Writes one order's section of `out` (see the top); keys[i].row < 0: row i is not eligible. */
static void settle(const best_rows *b, const rank_key *keys, int64_t n, int64_t want, const int64_t *scan_pos,
                   int64_t sum_total, int64_t *out) {
    int64_t *best = out + 3, *groups = best + want, *tied = groups + want;
    int64_t nb = b->kept, nt = 0;
    if (b->kept == want) { /* the cut: every row whose key equals the want-th smallest */
        const rank_key *cut = &b->buf[want - 1];
        nb = 0;
        while (nb < want && !key_same(&b->buf[nb], cut)) nb++;
        if (cut->tie) { /* (tie positions: keys are distinct, the cut is one row) */
            tied[nt++] = cut->row;
        } else {
            for (int64_t i = 0; i < n; i++) {
                rank_key k = keys[i];
                if (k.row < 0) continue;
                k.scan = scan_pos ? scan_pos[i] : 0;
                if (key_same(&k, cut)) tied[nt++] = i;
            }
        }
    }
    for (int64_t j = 0, g = 0; j < nb; j++) {
        g += j > 0 && !key_same(&b->buf[j], &b->buf[j - 1]);
        best[j] = b->buf[j].row;
        groups[j] = g;
    }
    out[0] = nb;
    out[1] = nt;
    out[2] = sum_total;
}

/* ints: free, total, evictable, active, each n int64 (the snapshot's column block). scan_pos
 * given: a second section, for the scan order, follows the first at out + 3 + 2 * want + n.
 * tie_pos: every row's rendezvous position (1-based ties are then none), or NULL.
 * Returns 0; -1 when want is out of range, -2 when no memory (nothing written). */
int64_t pagedkv_rank_rooms(int64_t n, const int64_t *ints, const double *opens, const int64_t *scan_pos,
                           const int64_t *tie_pos, int64_t need, double c0, double lw, double s1,
                           double opens_scale, double k1, double margin, int64_t both, double k2,
                           double m2, int64_t want, int64_t *out) {
    if (want < 1 || want > MAX_WANT || n < 0) return -1;
    const int64_t *free_ = ints, *total = ints + n, *evictable = ints + 2 * n, *active = ints + 3 * n;
    rank_key *keys = malloc((size_t)(n ? n : 1) * sizeof(rank_key));
    if (!keys) return -2;
    int64_t sum_total = 0;
    for (int64_t i = 0; i < n; i++) sum_total += total[i];
    best_rows plain = {.kept = 0}, scan = {.kept = 0};
    for (int64_t i = 0; i < n; i++) {
        rank_key *k = &keys[i];
        int64_t room = free_[i] + evictable[i];
        if (need > room) {
            k->row = -1;
            continue;
        }
        int64_t load = active[i] < 0 ? total[i] - room : active[i];
        k->cost = c0 + lw * (double)(load + need);
        double fair = sum_total ? (s1 * (double)total[i]) / (double)sum_total : 0.0;
        double o = opens[i] / opens_scale + 1.0;
        int over = o > k1 * fair + margin;
        if (both) over = over && o > k2 * fair + m2;
        k->over = over;
        k->scan = 0;
        /* 1-based: 0 stays "no position" (a tie the caller settles) */
        k->tie = tie_pos ? tie_pos[i] + 1 : 0;
        k->row = i;
        offer(&plain, k, want);
        if (scan_pos) {
            rank_key s = *k;
            s.scan = scan_pos[i];
            offer(&scan, &s, want);
        }
    }
    settle(&plain, keys, n, want, NULL, sum_total, out);
    if (scan_pos) settle(&scan, keys, n, want, scan_pos, sum_total, out + 3 + 2 * want + n);
    free(keys);
    return 0;
}
