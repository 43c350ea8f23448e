/* The host copy helper (kvtier_async/transfer/hostcopy.py), built with the package. */
#include <stdint.h>
#include <string.h>

/* Copy n byte runs: size[i] bytes from address src[i] to address dst[i]. Runs that
   continue the previous one on both sides are joined into one memmove. */
void kvtier_batch_copy(const int64_t *src, const int64_t *dst, const int64_t *size,
                       int64_t n) {
    int64_t i = 0;
    while (i < n) {
        int64_t s = src[i], d = dst[i], k = size[i];
        while (i + 1 < n && src[i + 1] == s + k && dst[i + 1] == d + k)
            k += size[++i];
        memmove((void *)(intptr_t)d, (const void *)(intptr_t)s, (size_t)k);
        ++i;
    }
}

/* Plan a transfer between device blocks and host slots (kvtier_async/transfer/plan.py,
   `Planner`): the merged byte runs of `plan_transfer(...).merged()`, for groups whose views
   each hold a page in one run.

   meta: n_groups, factor, host_address, host_stride, num_slots, to_host, then per group
         n_views, min_blocks, then per view address, block_stride, page_size, offset.
   spans: per group its block count and the index of its first block (GPUSpec's
          group_sizes and block_indices, interleaved).
   out: room for `cap` runs: sources at out[0..cap), destinations at out[cap..2cap),
        sizes at out[2cap..3cap).

   Runs go group by group, view by view, block by block (plan_transfer's order); a run that
   continues the previous one on both sides is joined to it. Every id is checked before an
   address is formed. Returns the number of runs, or -1 for a block id out of range, -2 for
   a slot id out of range, -3 for specs that do not match, -4 for too little room in out:
   the caller plans it again in Python, which says what is wrong. */
int64_t kvtier_plan(const int64_t *meta, const int64_t *spans, const int64_t *blocks,
                    int64_t n_blocks, const int64_t *slots, int64_t n_slots, int64_t *out,
                    int64_t cap) {
    const int64_t n_groups = meta[0], factor = meta[1], host = meta[2], stride = meta[3];
    const uint64_t num_slots = (uint64_t)meta[4];
    const int to_host = meta[5] != 0;
    const int64_t *group = meta + 6;
    int64_t *src = out, *dst = out + cap, *size = out + 2 * cap;
    /* The run being built (n runs written before it): kept in registers, not re-read. */
    int64_t n = 0, run_src = 0, run_dst = 0, run_size = 0;
    int64_t block_pos = 0, slot_pos = 0;
    for (int64_t i = 0; i < n_slots; ++i)
        if ((uint64_t)slots[i] >= num_slots)
            return -2;
    for (int64_t g = 0; g < n_groups; ++g) {
        const int64_t n_views = group[0];
        const uint64_t min_blocks = (uint64_t)group[1];
        const int64_t *view = group + 2;
        const int64_t count = spans[2 * g];
        const int64_t skip = (spans[2 * g + 1] % factor + factor) % factor; /* as Python's % */
        group = view + 4 * n_views;
        if (count == 0)
            continue;
        if (count < 0)
            return -3;
        const int64_t used = (skip + count + factor - 1) / factor;
        if (block_pos + count > n_blocks || slot_pos + used > n_slots)
            return -3;
        const int64_t *b = blocks + block_pos, *s = slots + slot_pos;
        for (int64_t i = 0; i < count; ++i)
            if ((uint64_t)b[i] >= min_blocks)
                return -1;
        for (int64_t v = 0; v < n_views; ++v) {
            const int64_t address = view[4 * v], block_stride = view[4 * v + 1];
            const int64_t page = view[4 * v + 2], offset = host + view[4 * v + 3];
            for (int64_t i = 0; i < count; ++i) {
                const int64_t device = address + b[i] * block_stride;
                int64_t slot;
                if (factor == 1) {
                    slot = offset + s[i] * stride;
                } else {
                    const int64_t logical = skip + i;
                    slot = offset + s[logical / factor] * stride + (logical % factor) * page;
                }
                const int64_t from = to_host ? device : slot, to = to_host ? slot : device;
                if (run_size > 0 && run_src + run_size == from && run_dst + run_size == to) {
                    run_size += page; /* continues the run on both sides */
                    continue;
                }
                if (run_size > 0) {
                    if (n == cap)
                        return -4;
                    src[n] = run_src;
                    dst[n] = run_dst;
                    size[n] = run_size;
                    ++n;
                }
                run_src = from;
                run_dst = to;
                run_size = page;
            }
        }
        block_pos += count;
        slot_pos += used;
    }
    if (block_pos != n_blocks || slot_pos != n_slots)
        return -3;
    if (run_size > 0) {
        if (n == cap)
            return -4;
        src[n] = run_src;
        dst[n] = run_dst;
        size[n] = run_size;
        ++n;
    }
    return n;
}

/* 1 when this file was compiled with optimization (`__OPTIMIZE__`, -O1 and up), else 0:
   tests/test_native.py fails on a helper built at -O0 (a CFLAGS in the environment replaces
   Python's own flags; pyproject.toml adds -O3 for that reason). */
int kvtier_optimized(void) {
#ifdef __OPTIMIZE__
    return 1;
#else
    return 0;
#endif
}
