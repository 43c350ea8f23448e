"""The fs tier's batch I/O in C: a whole chunk of stores or loads per call, GIL released.

`FsTier` moves a chunk of blocks per worker-thread call. In Python each block costs about
ten system calls and their wrappers, a CRC-32C pass, header packing and, between every
step, a fight for the GIL with 15 other workers and the event loop: on the 2-core dev box
that held 256 KiB stores to 0.55-0.74x of parallel ``dd``. Here the same steps run as one C
loop per chunk (`store_blocks`, `load_blocks`), called through ctypes, which releases the
GIL for the whole chunk; Python keeps what needs its data structures (paths, the directory
cache, the access record, logging). The file format and the outcome of every step are those
of the Python path in `kvtier_async.tiers.fs`, which remains the fallback (no C compiler,
``KVTIER_NATIVE_FS=0``) and the reference the tests hold this one to.

Per block, a store: ``stat`` the final name unless the directory is new (a complete file
there: done; a wrong-sized regular file: deleted, noted), CRC-32C the payload into the
header Python prepared, CRC-32C the header, ``open(O_CREAT|O_EXCL[|O_DIRECT])`` the named
temporary, ``pwritev`` header and payload, optional ``fsync``, ``close``, ``rename``. On a
failure the temporary is unlinked and the step and ``errno`` are reported. A load: ``open``
(``ENOENT``: a miss), ``preadv`` into [header page, slot], the same checks as
`kvtier_async.tiers.fs.verify_block` in the same order, and on a failure the file's device
and inode (so Python deletes only that file).

CRC-32C uses SSE 4.2 on x86-64 (three interleaved streams joined by zero-append operators,
Mark Adler's method: 2.5-3x one stream) or the ARMv8 CRC instructions when the CPU has them,
else a slicing-by-8 table; `native_fsio` checks it against the ``crc32c`` package before
use.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from dataclasses import dataclass
from typing import Final

import crc32c

from kvtier_async._log import get_logger
from kvtier_async._native import BUILD_ERRORS, build_library, disabled

__all__ = [
    "LOAD_BAD_HEADER",
    "LOAD_BAD_LENGTH",
    "LOAD_BAD_PAYLOAD",
    "LOAD_FOREIGN",
    "LOAD_MISSING",
    "LOAD_OK",
    "LOAD_SHORT",
    "LOAD_WRONG_KEY",
    "STEP_NAMES",
    "STORE_PRESENT",
    "STORE_WRITTEN",
    "FsIo",
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

_SOURCE: Final = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
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
__attribute__((target("sse4.2")))
static uint32_t crc_hard(uint32_t c32, const unsigned char *p, size_t n) {
    uint64_t c0 = c32, c1, c2;
    while (n && ((uintptr_t)p & 7)) { c0 = _mm_crc32_u8((uint32_t)c0, *p++); n--; }
    while (n >= 3 * LONG) {
        const unsigned char *end = p + LONG;
        c1 = c2 = 0;
        do {
            c0 = _mm_crc32_u64(c0, *(const uint64_t *)p);
            c1 = _mm_crc32_u64(c1, *(const uint64_t *)(p + LONG));
            c2 = _mm_crc32_u64(c2, *(const uint64_t *)(p + 2 * LONG));
            p += 8;
        } while (p < end);
        c0 = shift(zeros_long, (uint32_t)c0) ^ (uint32_t)c1;
        c0 = shift(zeros_long, (uint32_t)c0) ^ (uint32_t)c2;
        p += 2 * LONG; n -= 3 * LONG;
    }
    while (n >= 3 * SHORT) {
        const unsigned char *end = p + SHORT;
        c1 = c2 = 0;
        do {
            c0 = _mm_crc32_u64(c0, *(const uint64_t *)p);
            c1 = _mm_crc32_u64(c1, *(const uint64_t *)(p + SHORT));
            c2 = _mm_crc32_u64(c2, *(const uint64_t *)(p + 2 * SHORT));
            p += 8;
        } while (p < end);
        c0 = shift(zeros_short, (uint32_t)c0) ^ (uint32_t)c1;
        c0 = shift(zeros_short, (uint32_t)c0) ^ (uint32_t)c2;
        p += 2 * SHORT; n -= 3 * SHORT;
    }
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

/* Store n blocks. Per block i: temps[i] (named temporary), finals[i], check[i] (stat the
   final name first), heads[i] (a header page whose bytes Python filled except the payload
   sum at sum_at and the header sum at head_n - 8), bodies[i] (body_n bytes), flags[i]
   (extra open flags). Out: result[i] (2 written, 1 present, -errno), step[i] (which call
   failed), noted[i] (1: a wrong-sized file at the final name was deleted). */
void kvtier_store_blocks(int64_t n, char **temps, char **finals, const int32_t *check,
                         unsigned char **heads, unsigned char **bodies, const int32_t *flags,
                         int64_t head_n, int64_t body_n, int64_t sum_at, int32_t do_fsync,
                         int32_t *result, int32_t *step, int32_t *noted) {
    int64_t file_n = head_n + body_n;
    for (int64_t i = 0; i < n; i++) {
        step[i] = 0; noted[i] = 0;
        if (check[i]) {
            struct stat st;
            if (stat(finals[i], &st) == 0) {
                if (S_ISREG(st.st_mode) && st.st_size == file_n) { result[i] = 1; continue; }
                if (S_ISREG(st.st_mode) && unlink(finals[i]) == 0) noted[i] = 1;
            }
        }
        unsigned char *head = heads[i];
        uint64_t sum = kvtier_crc32c(bodies[i], (size_t)body_n);
        memcpy(head + sum_at, &sum, 8);
        uint64_t head_sum = kvtier_crc32c(head, (size_t)head_n - 8);
        memcpy(head + head_n - 8, &head_sum, 8);
        int fd = open(temps[i], O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | flags[i], 0644);
        if (fd < 0) { result[i] = -errno; step[i] = 1; continue; }
        int64_t wrote = move_all(fd, 1, head, (size_t)head_n, bodies[i], (size_t)body_n);
        int err = wrote < 0 ? (int)wrote : 0;
        if (err) step[i] = 2;
        if (!err && do_fsync && fsync(fd) != 0) { err = -errno; step[i] = 3; }
        close(fd);
        if (!err && rename(temps[i], finals[i]) != 0) { err = -errno; step[i] = 4; }
        if (err) { unlink(temps[i]); result[i] = err; continue; }
        result[i] = 2;
    }
}

/* Load n blocks. Per block i: paths[i], heads[i] (a page-aligned scratch page, head_n
   bytes), bodies[i], flags[i], expect[i] (the first 56 header bytes of this key's file,
   payload sum zeroed). Out: result[i] (1 good, 0 missing, -errno, or 10..15: see the
   LOAD_ constants), got[i] (bytes read), dev[i]/ino[i] (the file read, on a failure). */
void kvtier_load_blocks(int64_t n, char **paths, unsigned char **heads,
                        unsigned char **bodies, const int32_t *flags,
                        const unsigned char *expect, int64_t head_n, int64_t body_n,
                        int64_t sum_at, int32_t *result, int32_t *step, int64_t *got,
                        uint64_t *dev, uint64_t *ino) {
    for (int64_t i = 0; i < n; i++) {
        step[i] = 0; got[i] = 0; dev[i] = 0; ino[i] = 0;
        int fd = open(paths[i], O_RDONLY | O_CLOEXEC | flags[i]);
        if (fd < 0) {
            result[i] = errno == ENOENT ? 0 : -errno;
            step[i] = 1;
            continue;
        }
        unsigned char *head = heads[i];
        const unsigned char *want = expect + 56 * i;
        int64_t r = move_all(fd, 0, head, (size_t)head_n, bodies[i], (size_t)body_n);
        int res = 1;
        uint64_t stored;
        if (r < 0) { res = (int)r; step[i] = 2; }
        else if (r != head_n + body_n) res = 10;
        else if (memcpy(&stored, head + head_n - 8, 8),
                 stored != kvtier_crc32c(head, (size_t)head_n - 8)) res = 11;
        else if (memcmp(head, want, 10) || memcmp(head + 12, want + 12, 4) ||
                 memcmp(head + 40, want + 40, 16)) res = 12;
        else if (memcmp(head + 16, want + 16, 8)) res = 13;
        else if (memcmp(head + 32, want + 32, 8)) res = 14;
        else if (memcpy(&stored, head + sum_at, 8),
                 stored != kvtier_crc32c(bodies[i], (size_t)body_n)) res = 15;
        got[i] = r < 0 ? 0 : r;
        if (res != 1) {
            struct stat st;
            if (fstat(fd, &st) == 0) { dev[i] = st.st_dev; ino[i] = st.st_ino; }
        }
        close(fd);
        result[i] = res;
    }
}
"""

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int32


@dataclass(frozen=True)
class FsIo:
    """The compiled helper: `store_blocks`, `load_blocks` and `crc32c` (see the module
    docstring for the arguments; arrays are passed by address)."""

    library: ctypes.CDLL
    hardware_crc: bool

    def crc32c(self, address: int, nbytes: int) -> int:
        value: int = self.library.kvtier_crc32c(address, nbytes)
        return value

    @property
    def store_blocks(self) -> ctypes._NamedFuncPointer:
        return self.library.kvtier_store_blocks

    @property
    def load_blocks(self) -> ctypes._NamedFuncPointer:
        return self.library.kvtier_load_blocks

    def describe(self) -> str:
        return f"native(crc32c={'hardware' if self.hardware_crc else 'table'})"


@functools.cache
def native_fsio() -> FsIo | None:
    """The compiled helper, or None when disabled (``KVTIER_NATIVE_FS=0``), not Linux, or
    it cannot be built, or its CRC-32C disagrees with the ``crc32c`` package."""
    if disabled("KVTIER_NATIVE_FS") or not hasattr(os, "O_DIRECT"):
        return None
    flags = ["-std=gnu11"]
    try:
        library = ctypes.CDLL(str(build_library("fsio", _SOURCE, flags)))
    except BUILD_ERRORS as exc:
        log.info("native fs I/O unavailable; using the Python path", error=str(exc))
        return None
    library.kvtier_crc32c.argtypes = [_P, ctypes.c_size_t]
    library.kvtier_crc32c.restype = ctypes.c_uint32
    library.kvtier_crc32c_hardware.argtypes = []
    library.kvtier_crc32c_hardware.restype = ctypes.c_int
    library.kvtier_store_blocks.argtypes = [_I64, *[_P] * 6, _I64, _I64, _I64, _I32, _P, _P, _P]
    library.kvtier_store_blocks.restype = None
    library.kvtier_load_blocks.argtypes = [_I64, *[_P] * 5, _I64, _I64, _I64, *[_P] * 5]
    library.kvtier_load_blocks.restype = None
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
