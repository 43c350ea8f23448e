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
