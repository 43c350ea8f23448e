"""The fs tier's batch I/O in C: the blocks of a batch spread over C worker threads, no GIL.

`FsTier` hands each store or load batch to this helper. In Python each block costs about
ten system calls and their wrappers, a CRC-32C pass, header packing and, between every
step, a fight for the GIL with 15 other workers and the event loop: on the 2-core dev box
that held 256 KiB stores to 0.55-0.74x of parallel ``dd``. Here the same steps run in C
(`FsIo.run`), called through ctypes, which releases the GIL for the whole batch; Python
keeps what needs its data structures (paths, the directory cache, the access record,
logging). The file format and the outcome of every step are those of the Python path in
`kvtier_async.tiers.fs`, which remains the fallback (no C compiler, ``KVTIER_NATIVE_FS=0``)
and the reference the tests hold this one to.

A batch runs on a `Pool`: ``n`` C threads (named ``kvfs-r-<tier>`` / ``kvfs-w-<tier>``)
that take the blocks of the queued batches one at a time, in order, while the calling
thread waits; so one worker-thread call per batch keeps ``n`` blocks in flight, and a
2 MiB block costs no thread hop of its own (per 2 MiB load: 0.19 instead of 0.27 core-s/GB
measured, with one call per two blocks before). Without a pool (none could start, it is
closed, or this is a forked child, which has none of its threads) a batch runs in the
calling thread.

Per block, a store: ``lstat`` the final name unless the directory is new (a complete file
there: done; a wrong-sized regular file or a symbolic link: deleted, noted), CRC-32C the
payload into the header Python prepared, CRC-32C the header,
``open(O_CREAT|O_EXCL|O_NOFOLLOW[|O_DIRECT], mode)`` the named temporary (and ``fchmod`` it
to ``mode`` when asked: the umask may have narrowed it), ``pwritev`` header and payload,
optional ``fsync``, ``close``, ``rename``. On a failure the temporary is unlinked and the
step and ``errno`` are reported. A load: ``open(O_NOFOLLOW)`` (``ENOENT``: a miss; a
symbolic link fails with ``ELOOP``, never followed), ``fstat``, ``preadv`` into [header page,
slot], the same checks as `kvtier_async.tiers.fs.verify_block` in the same order (a file
of the wrong size or not regular fails after the short-read check), and on a failure the
file's device and inode (so Python deletes only that file).

CRC-32C uses SSE 4.2 on x86-64 (three interleaved streams joined by zero-append operators,
Mark Adler's method: 2.5-3x one stream) or the ARMv8 CRC instructions when the CPU has them,
else a slicing-by-8 table; `native_fsio` checks it against the ``crc32c`` package before
use.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

import crc32c

from kvtier_async._log import get_logger
from kvtier_async._native import BUILD_ERRORS, build_library, disabled

__all__ = [
    "LOAD_BAD_HEADER",
    "LOAD_BAD_LENGTH",
    "LOAD_BAD_PAYLOAD",
    "LOAD_BAD_SIZE",
    "LOAD_FOREIGN",
    "LOAD_MISSING",
    "LOAD_OK",
    "LOAD_SHORT",
    "LOAD_WRONG_KEY",
    "STEP_NAMES",
    "STORE_PRESENT",
    "STORE_WRITTEN",
    "FsIo",
    "LoadArgs",
    "Pool",
    "PoolClosedError",
    "StoreArgs",
    "native_fsio",
]

log = get_logger(__name__)

# Store results (per block): a negative value is -errno of the step in ``steps``.
STORE_PRESENT: Final = 1
STORE_WRITTEN: Final = 2
STEP_NAMES: Final = {1: "open", 2: "write", 3: "fsync", 4: "rename", 5: "stat"}
# Load results (per block): negative is -errno of open (step 1) or read (step 2).
LOAD_MISSING: Final = 0
LOAD_OK: Final = 1
LOAD_SHORT: Final = 10
LOAD_BAD_HEADER: Final = 11  # header checksum mismatch
LOAD_FOREIGN: Final = 12  # not a block file of this format
LOAD_BAD_LENGTH: Final = 13
LOAD_WRONG_KEY: Final = 14
LOAD_BAD_PAYLOAD: Final = 15
LOAD_BAD_SIZE: Final = 16  # longer than a block file, or not a regular file

_SOURCE: Final = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

/* -- CRC-32C (Castagnoli), the value of the crc32c package -------------------------- */

static uint32_t table[8][256];

__attribute__((constructor)) static void make_table(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int t = 1; t < 8; t++)
            table[t][n] = (table[t - 1][n] >> 8) ^ table[0][table[t - 1][n] & 0xFF];
}

static uint32_t crc_soft(uint32_t c, const unsigned char *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) { c = table[0][(c ^ *p++) & 0xFF] ^ (c >> 8); n--; }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= c;
        c = table[7][w & 0xFF] ^ table[6][(w >> 8) & 0xFF] ^ table[5][(w >> 16) & 0xFF] ^
            table[4][(w >> 24) & 0xFF] ^ table[3][(w >> 32) & 0xFF] ^
            table[2][(w >> 40) & 0xFF] ^ table[1][(w >> 48) & 0xFF] ^ table[0][w >> 56];
        p += 8; n -= 8;
    }
    while (n) { c = table[0][(c ^ *p++) & 0xFF] ^ (c >> 8); n--; }
    return c;
}

/* Three interleaved streams (the CRC instruction has a latency of three cycles and a
   throughput of one), joined by "append this many zero bytes" operators: Mark Adler's
   method (crc32c.c, zlib licence). */
#define POLY 0x82F63B78u
#define LONG 8192
#define SHORT 256
static uint32_t zeros_long[4][256], zeros_short[4][256];

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) { if (vec & 1) sum ^= *mat; vec >>= 1; mat++; }
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) square[n] = gf2_times(mat, mat[n]);
}

/* The operator that appends len (a power of two) zero bytes to a CRC. */
static void zeros_op(uint32_t *even, size_t len) {
    uint32_t odd[32], row = 1;
    odd[0] = POLY;
    for (int n = 1; n < 32; n++) { odd[n] = row; row <<= 1; }
    gf2_square(even, odd);  /* two zero bits */
    gf2_square(odd, even);  /* four */
    do {
        gf2_square(even, odd);
        len >>= 1;
        if (len == 0) return;
        gf2_square(odd, even);
        len >>= 1;
    } while (len);
    for (int n = 0; n < 32; n++) even[n] = odd[n];
}

static void make_zeros(uint32_t zeros[][256], size_t len) {
    uint32_t op[32];
    zeros_op(op, len);
    for (uint32_t n = 0; n < 256; n++) {
        zeros[0][n] = gf2_times(op, n);
        zeros[1][n] = gf2_times(op, n << 8);
        zeros[2][n] = gf2_times(op, n << 16);
        zeros[3][n] = gf2_times(op, n << 24);
    }
}

__attribute__((constructor)) static void make_zeros_tables(void) {
    make_zeros(zeros_long, LONG);
    make_zeros(zeros_short, SHORT);
}

static uint32_t shift(uint32_t zeros[][256], uint32_t crc) {
    return zeros[0][crc & 0xFF] ^ zeros[1][(crc >> 8) & 0xFF] ^
           zeros[2][(crc >> 16) & 0xFF] ^ zeros[3][crc >> 24];
}

#if defined(__x86_64__)
#include <nmmintrin.h>
/* One round: three streams of len bytes from p (len a multiple of 8), the second and third
   appended to the first by the zero-append operator for len bytes. Inlined with a constant
   len, so each caller's loop is as if written out. */
__attribute__((target("sse4.2"), always_inline))
static inline uint64_t crc_three(uint64_t c0, const unsigned char *p, size_t len,
                                 uint32_t zeros[][256]) {
    const unsigned char *end = p + len;
    uint64_t c1 = 0, c2 = 0;
    do {
        c0 = _mm_crc32_u64(c0, *(const uint64_t *)p);
        c1 = _mm_crc32_u64(c1, *(const uint64_t *)(p + len));
        c2 = _mm_crc32_u64(c2, *(const uint64_t *)(p + 2 * len));
        p += 8;
    } while (p < end);
    c0 = shift(zeros, (uint32_t)c0) ^ (uint32_t)c1;
    return shift(zeros, (uint32_t)c0) ^ (uint32_t)c2;
}

__attribute__((target("sse4.2")))
static uint32_t crc_hard(uint32_t c32, const unsigned char *p, size_t n) {
    uint64_t c0 = c32;
    while (n && ((uintptr_t)p & 7)) { c0 = _mm_crc32_u8((uint32_t)c0, *p++); n--; }
    for (; n >= 3 * LONG; p += 3 * LONG, n -= 3 * LONG) c0 = crc_three(c0, p, LONG, zeros_long);
    for (; n >= 3 * SHORT; p += 3 * SHORT, n -= 3 * SHORT)
        c0 = crc_three(c0, p, SHORT, zeros_short);
    while (n >= 8) { c0 = _mm_crc32_u64(c0, *(const uint64_t *)p); p += 8; n -= 8; }
    while (n) { c0 = _mm_crc32_u8((uint32_t)c0, *p++); n--; }
    return (uint32_t)c0;
}
static int have_hard(void) { return __builtin_cpu_supports("sse4.2"); }
#elif defined(__aarch64__)
#include <arm_acle.h>
#include <sys/auxv.h>
#ifndef HWCAP_CRC32
#define HWCAP_CRC32 (1 << 7)
#endif
__attribute__((target("+crc")))
static uint32_t crc_hard(uint32_t c, const unsigned char *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) { c = __crc32cb(c, *p++); n--; }
    while (n >= 8) { c = __crc32cd(c, *(const uint64_t *)p); p += 8; n -= 8; }
    while (n) { c = __crc32cb(c, *p++); n--; }
    return c;
}
static int have_hard(void) { return (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0; }
#else
static uint32_t crc_hard(uint32_t c, const unsigned char *p, size_t n) {
    return crc_soft(c, p, n);
}
static int have_hard(void) { return 0; }
#endif

static int hard = -1;

uint32_t kvtier_crc32c(const void *buf, size_t n) {
    if (hard < 0) hard = have_hard();
    uint32_t c = 0xFFFFFFFFu;
    c = hard ? crc_hard(c, buf, n) : crc_soft(c, buf, n);
    return ~c;
}

int kvtier_crc32c_hardware(void) {
    if (hard < 0) hard = have_hard();
    return hard;
}

/* -- whole-file writes and reads ----------------------------------------------------- */

/* Write (writing != 0) or read head then body at offset 0 of fd, resuming after short
   transfers. Returns the bytes moved (fewer than asked only when a read meets the end of the
   file) or -errno; a write that moves nothing is -EIO. */
static int64_t move_all(int fd, int writing, unsigned char *head, size_t head_n,
                        unsigned char *body, size_t body_n) {
    size_t total = head_n + body_n, done = 0;
    while (done < total) {
        struct iovec iov[2];
        int k = 0;
        if (done < head_n) {
            iov[k].iov_base = head + done; iov[k].iov_len = head_n - done; k++;
            iov[k].iov_base = body; iov[k].iov_len = body_n; k++;
        } else {
            iov[k].iov_base = body + (done - head_n); iov[k].iov_len = total - done; k++;
        }
        off_t at = (off_t)done;
        ssize_t moved = writing ? pwritev(fd, iov, k, at) : preadv(fd, iov, k, at);
        if (moved < 0) { if (errno == EINTR) continue; return -errno; }
        if (moved == 0) { if (writing) return -EIO; break; }
        done += (size_t)moved;
    }
    return (int64_t)done;
}

/* -- one block's store and load -------------------------------------------------------- */

/* A batch of stores. Per block i: temps[i] (named temporary), finals[i], check[i] (stat the
   final name first), heads[i] (a header page whose bytes Python filled except the payload
   sum at sum_at and the header sum at head_n - 8), bodies[i] (body_n bytes), flags[i]
   (extra open flags); file_mode (of the temporary; fchmod'ed to it if fix_mode). Out:
   result[i] (2 written, 1 present, -errno), step[i] (which call failed), noted[i] (1: a
   wrong-sized file or a symbolic link at the final name was deleted). */
struct store_args {
    int64_t n;
    char **temps, **finals;
    const int32_t *check;
    unsigned char **heads, **bodies;
    const int32_t *flags;
    int64_t head_n, body_n, sum_at;
    int32_t do_fsync, file_mode, fix_mode;
    int32_t *result, *step, *noted;
};

static void store_one(const struct store_args *a, int64_t i) {
    int64_t head_n = a->head_n, body_n = a->body_n;
    a->step[i] = 0; a->noted[i] = 0;
    if (a->check[i]) {
        struct stat st;
        if (lstat(a->finals[i], &st) == 0) {
            if (S_ISREG(st.st_mode) && st.st_size == head_n + body_n) {
                a->result[i] = 1;
                return;
            }
            if ((S_ISREG(st.st_mode) || S_ISLNK(st.st_mode)) && unlink(a->finals[i]) == 0)
                a->noted[i] = 1;
        }
    }
    unsigned char *head = a->heads[i];
    uint64_t sum = kvtier_crc32c(a->bodies[i], (size_t)body_n);
    memcpy(head + a->sum_at, &sum, 8);
    uint64_t head_sum = kvtier_crc32c(head, (size_t)head_n - 8);
    memcpy(head + head_n - 8, &head_sum, 8);
    int fd = open(a->temps[i], O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW | a->flags[i],
                  (mode_t)a->file_mode);
    if (fd < 0) { a->result[i] = -errno; a->step[i] = 1; return; }
    int err = 0;
    if (a->fix_mode && fchmod(fd, (mode_t)a->file_mode) != 0) { err = -errno; a->step[i] = 1; }
    if (!err) {
        int64_t wrote = move_all(fd, 1, head, (size_t)head_n, a->bodies[i], (size_t)body_n);
        if (wrote < 0) { err = (int)wrote; a->step[i] = 2; }
    }
    if (!err && a->do_fsync && fsync(fd) != 0) { err = -errno; a->step[i] = 3; }
    close(fd);
    if (!err && rename(a->temps[i], a->finals[i]) != 0) { err = -errno; a->step[i] = 4; }
    if (err) { unlink(a->temps[i]); a->result[i] = err; return; }
    a->result[i] = 2;
}

/* A batch of loads. Per block i: paths[i], heads[i] (a page-aligned scratch page, head_n
   bytes), bodies[i], flags[i], expect + 56 * i (the first 56 header bytes of this key's
   file, payload sum zeroed). Out: result[i] (1 good, 0 missing, -errno, or 10..16: see the
   LOAD_ constants), step[i], got[i] (bytes read; for 16 the file's size), dev[i]/ino[i]
   (the file read, on a failure). */
struct load_args {
    int64_t n;
    char **paths;
    unsigned char **heads, **bodies;
    const int32_t *flags;
    const unsigned char *expect;
    int64_t head_n, body_n, sum_at;
    int32_t *result, *step;
    int64_t *got;
    uint64_t *dev, *ino;
};

static void load_one(const struct load_args *a, int64_t i) {
    int64_t head_n = a->head_n, body_n = a->body_n;
    a->step[i] = 0; a->got[i] = 0; a->dev[i] = 0; a->ino[i] = 0;
    int fd = open(a->paths[i], O_RDONLY | O_CLOEXEC | O_NOFOLLOW | a->flags[i]);
    if (fd < 0) {
        a->result[i] = errno == ENOENT ? 0 : -errno;
        a->step[i] = 1;
        return;
    }
    unsigned char *head = a->heads[i], *body = a->bodies[i];
    const unsigned char *want = a->expect + 56 * i;
    struct stat st;
    int have_st = fstat(fd, &st) == 0;
    int64_t r = move_all(fd, 0, head, (size_t)head_n, body, (size_t)body_n);
    int res = 1;
    uint64_t stored;
    if (r < 0) { res = (int)r; a->step[i] = 2; }
    else if (r != head_n + body_n) res = 10;
    else if (!have_st || !S_ISREG(st.st_mode) || st.st_size != head_n + body_n) {
        res = 16;
        r = have_st ? (int64_t)st.st_size : r;
    }
    else if (memcpy(&stored, head + head_n - 8, 8),
             stored != kvtier_crc32c(head, (size_t)head_n - 8)) res = 11;
    else if (memcmp(head, want, 10) || memcmp(head + 12, want + 12, 4) ||
             memcmp(head + 40, want + 40, 16)) res = 12;
    else if (memcmp(head + 16, want + 16, 8)) res = 13;
    else if (memcmp(head + 32, want + 32, 8)) res = 14;
    else if (memcpy(&stored, head + a->sum_at, 8),
             stored != kvtier_crc32c(body, (size_t)body_n)) res = 15;
    a->got[i] = r < 0 ? 0 : r;
    if (res != 1 && have_st) { a->dev[i] = st.st_dev; a->ino[i] = st.st_ino; }
    close(fd);
    a->result[i] = res;
}

#define KIND_STORE 0
#define KIND_LOAD 1

static void run_one(int kind, void *args, int64_t i) {
    if (kind == KIND_STORE) store_one(args, i);
    else load_one(args, i);
}

/* -- the worker pool ------------------------------------------------------------------ */

/* A job is one batch; it lives on its caller's stack until its last block is done. Workers
   take the blocks of the job at the head of the queue one at a time, in order. */
struct job {
    int kind;
    void *args;
    int64_t n, next, done;
    pthread_cond_t finished;
    struct job *link;
};

struct pool {
    pthread_mutex_t mu;
    pthread_cond_t work;
    struct job *head, *tail;
    int stop, nthreads;
    pthread_t threads[];
};

static void *worker(void *arg) {
    struct pool *p = arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->head && !p->stop) pthread_cond_wait(&p->work, &p->mu);
        struct job *j = p->head;
        if (!j) break;  /* stopping, and nothing is left */
        int64_t i = j->next++;
        if (j->next == j->n) { p->head = j->link; if (!p->head) p->tail = NULL; }
        pthread_mutex_unlock(&p->mu);
        run_one(j->kind, j->args, i);
        pthread_mutex_lock(&p->mu);
        if (++j->done == j->n) pthread_cond_signal(&j->finished);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/* A worker needs little stack (a struct stat, two iovecs, libc's system call wrappers);
   the default of 8 MiB each would reserve 8 GiB of address space for 1024 workers. */
#define WORKER_STACK (256 * 1024)

/* Start nthreads workers named name (at most 15 characters), with every signal blocked so
   that signals keep going to the interpreter's threads. NULL when not even one starts. */
void *kvtier_pool_new(int32_t nthreads, const char *name) {
    if (nthreads < 1) return NULL;
    struct pool *p = calloc(1, sizeof *p + (size_t)nthreads * sizeof(pthread_t));
    if (!p) return NULL;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work, NULL);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, WORKER_STACK);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    for (int k = 0; k < nthreads; k++) {
        if (pthread_create(&p->threads[k], &attr, worker, p) != 0) break;
        pthread_setname_np(p->threads[k], name);
        p->nthreads++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (p->nthreads == 0) {
        pthread_cond_destroy(&p->work);
        pthread_mutex_destroy(&p->mu);
        free(p);
        return NULL;
    }
    return p;
}

int32_t kvtier_pool_threads(void *pool) { return ((struct pool *)pool)->nthreads; }

/* Let the workers finish what is queued, join them, free the pool. No job may be submitted
   during or after this call. */
void kvtier_pool_free(void *pool) {
    struct pool *p = pool;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->work);
    pthread_mutex_unlock(&p->mu);
    for (int k = 0; k < p->nthreads; k++) pthread_join(p->threads[k], NULL);
    pthread_cond_destroy(&p->work);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

/* Run a batch (kind KIND_STORE with a struct store_args, KIND_LOAD with a struct load_args):
   on the pool's workers, returning when every block is done, or in the calling thread when
   pool is NULL. */
void kvtier_run(void *pool, int32_t kind, void *args) {
    int64_t n = *(int64_t *)args;
    if (n <= 0) return;
    if (!pool) {
        for (int64_t i = 0; i < n; i++) run_one(kind, args, i);
        return;
    }
    struct pool *p = pool;
    struct job j = {.kind = kind, .args = args, .n = n};
    pthread_cond_init(&j.finished, NULL);
    pthread_mutex_lock(&p->mu);
    if (p->tail) p->tail->link = &j; else p->head = &j;
    p->tail = &j;
    for (int64_t k = 0; k < n && k < p->nthreads; k++) pthread_cond_signal(&p->work);
    while (j.done < n) pthread_cond_wait(&j.finished, &p->mu);
    pthread_mutex_unlock(&p->mu);
    pthread_cond_destroy(&j.finished);
}
"""

_FLAGS: Final = ("-std=gnu11",)
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int32

KIND_STORE: Final = 0
KIND_LOAD: Final = 1


class StoreArgs(ctypes.Structure):
    """``struct store_args``: one batch of stores (arrays by address, one entry per block)."""

    _fields_ = [
        ("n", _I64), ("temps", _P), ("finals", _P), ("check", _P), ("heads", _P),
        ("bodies", _P), ("flags", _P), ("head_n", _I64), ("body_n", _I64), ("sum_at", _I64),
        ("do_fsync", _I32), ("file_mode", _I32), ("fix_mode", _I32), ("result", _P),
        ("step", _P), ("noted", _P),
    ]  # fmt: skip


class LoadArgs(ctypes.Structure):
    """``struct load_args``: one batch of loads (arrays by address, one entry per block)."""

    _fields_ = [
        ("n", _I64), ("paths", _P), ("heads", _P), ("bodies", _P), ("flags", _P),
        ("expect", _P), ("head_n", _I64), ("body_n", _I64), ("sum_at", _I64), ("result", _P),
        ("step", _P), ("got", _P), ("dev", _P), ("ino", _P),
    ]  # fmt: skip


@dataclass(frozen=True)
class FsIo:
    """The compiled helper: `run` a batch (see the module docstring), `crc32c`, and the
    worker pools (`Pool`)."""

    library: ctypes.CDLL
    hardware_crc: bool

    def crc32c(self, address: int, nbytes: int) -> int:
        value: int = self.library.kvtier_crc32c(address, nbytes)
        return value

    def run(self, pool: Pool | None, args: StoreArgs | LoadArgs) -> None:
        """Run one batch on ``pool``'s workers (None: in this thread); returns when done."""
        kind = KIND_STORE if isinstance(args, StoreArgs) else KIND_LOAD
        if pool is not None:
            try:
                with pool.use() as handle:
                    self.library.kvtier_run(handle, kind, ctypes.byref(args))
                return
            except PoolClosedError:
                pass  # closed under a call in flight, or a forked child: this thread
        self.library.kvtier_run(None, kind, ctypes.byref(args))

    def pool(self, threads: int, name: str) -> Pool | None:
        """A pool of ``threads`` workers named ``name``; None if no thread could start."""
        handle = self.library.kvtier_pool_new(threads, name.encode()[:15])
        if not handle:
            return None
        return Pool(self.library, handle, self.library.kvtier_pool_threads(handle), name)

    def describe(self) -> str:
        return f"native(crc32c={'hardware' if self.hardware_crc else 'table'})"


class Pool:
    """C worker threads for batches (``kvtier_pool_*``). `use` counts the calls in flight,
    so `close` frees the threads only after the last one has returned; after `close`, or in
    a child process after ``fork`` (which has none of the threads), `use` raises
    `PoolClosedError` and callers run the batch in their own thread instead."""

    def __init__(self, library: ctypes.CDLL, handle: int, threads: int, name: str) -> None:
        self._library = library
        self._handle: int | None = handle
        self._pid = os.getpid()
        self._busy = 0
        self._idle = threading.Condition()
        self.threads = threads
        self.name = name

    @contextlib.contextmanager
    def use(self) -> Iterator[int]:
        """The pool's handle, counted as in use for the ``with`` body."""
        with self._idle:
            if self._handle is None or self._pid != os.getpid():
                raise PoolClosedError(f"worker pool {self.name!r} is closed")
            self._busy += 1
            handle = self._handle
        try:
            yield handle
        finally:
            with self._idle:
                self._busy -= 1
                if not self._busy:
                    self._idle.notify_all()

    def close(self) -> None:
        """Blocking: wait for the calls in flight, then stop and join the workers."""
        with self._idle:
            handle, self._handle = self._handle, None
            self._idle.wait_for(lambda: not self._busy)
        if handle is not None and self._pid == os.getpid():
            self._library.kvtier_pool_free(handle)


class PoolClosedError(RuntimeError):
    """A batch was given to a `Pool` that is closed (or belongs to the parent process)."""


@functools.cache
def native_fsio() -> FsIo | None:
    """The compiled helper, or None when disabled (``KVTIER_NATIVE_FS=0``), not Linux, or
    it cannot be built, or its CRC-32C disagrees with the ``crc32c`` package."""
    if disabled("KVTIER_NATIVE_FS") or not hasattr(os, "O_DIRECT"):
        return None
    try:
        library = ctypes.CDLL(str(build_library("fsio", _SOURCE, _FLAGS)))
    except BUILD_ERRORS as exc:
        log.info("native fs I/O unavailable; using the Python path", error=str(exc))
        return None
    library.kvtier_crc32c.argtypes = [_P, ctypes.c_size_t]
    library.kvtier_crc32c.restype = ctypes.c_uint32
    library.kvtier_crc32c_hardware.argtypes = []
    library.kvtier_crc32c_hardware.restype = ctypes.c_int
    library.kvtier_run.argtypes = [_P, _I32, _P]
    library.kvtier_run.restype = None
    library.kvtier_pool_new.argtypes = [_I32, ctypes.c_char_p]
    library.kvtier_pool_new.restype = _P
    library.kvtier_pool_threads.argtypes = [_P]
    library.kvtier_pool_threads.restype = _I32
    library.kvtier_pool_free.argtypes = [_P]
    library.kvtier_pool_free.restype = None
    fsio = FsIo(library, bool(library.kvtier_crc32c_hardware()))
    sample = bytes(range(256)) * 17 + b"123456789"
    buffer = ctypes.create_string_buffer(sample, len(sample))
    for start in (0, 1, 3, 8, len(sample) - 9):
        address = ctypes.addressof(buffer) + start
        if fsio.crc32c(address, len(sample) - start) != crc32c.crc32c(sample[start:]):
            log.warning("native CRC-32C disagrees with the crc32c package; not using it",
                        machine=platform.machine())  # fmt: skip
            return None
    return fsio
