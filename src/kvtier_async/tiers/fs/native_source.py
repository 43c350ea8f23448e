"""What the fs tier's batch I/O helper (``_fsio.c`` beside this file, built with the package;
called by `kvtier_async.tiers.fs.native`) shares with Python: the block file layout
(`kvtier_async.tiers.blockfile.c_defines`) and the result codes, steps and batch kinds this
module defines for both sides, generated into ``_fsio_defs.h`` (`generated_header`), so no
offset or code is written twice; a test fails when the header is not current.

Per block, a store: ``lstat`` the final name unless the directory is new (a complete file
there: done; a wrong-sized regular file or a symbolic link: deleted, noted), CRC-32C the
payload into the header Python prepared, CRC-32C the header,
``open(O_CREAT|O_EXCL|O_NOFOLLOW[|O_DIRECT], mode)`` the named temporary (and ``fchmod`` it
to ``mode`` when asked: the umask may have narrowed it), ``pwritev`` header and payload,
optional ``fsync``, ``close``, ``rename``. Buffered (no O_DIRECT), the payload is written
first, in pieces of 256 KiB each checksummed right after the kernel's copy left it in this
core's cache, then the header: one cold pass over the block instead of two. A load:
``open(O_NOFOLLOW)`` (``ENOENT``: a miss; a symbolic link fails with ``ELOOP``, never
followed), ``fstat``, ``preadv`` into [header page, slot] (buffered: the header and the
payload's first 256 KiB, then the rest in pieces, each checksummed as it arrives), the same
checks as `kvtier_async.tiers.blockfile.verify_block` in the same order (a
file of the wrong size or not regular fails after the short-read check), and on a failure the
file's device and inode (so Python deletes only that file). A lookup batch: ``lstat`` each
name (a regular file of a block file's size); a store batch's new directories: ``mkdir`` each
(its parent first when missing); both in the calling thread.

CRC-32C uses SSE 4.2 on x86-64 (three interleaved streams joined by zero-append operators,
Mark Adler's method: 2.5-3x one stream; from 256 bytes, folding with VPCLMULQDQ where the CPU
has AVX-512 and it: 3-4x more) or the ARMv8 CRC instructions when the CPU has them, else a
slicing-by-8 table; `kvtier_async.tiers.fs.native.native_fsio` checks it against the
``crc32c`` package before use.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Final

from kvtier_async.tiers.blockfile import c_defines

__all__ = [
    "HEADER",
    "KIND_LOAD",
    "KIND_STORE",
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
    "STEP_OPEN",
    "STORE_FAILED",
    "STORE_PRESENT",
    "STORE_WRITTEN",
    "generated_header",
]

# Store results (per block): a negative value is -errno of the step in ``steps``. A store's
# outcome on either I/O path is one of STORE_FAILED (Python's; C reports -errno), STORE_PRESENT
# (a complete file was there) and STORE_WRITTEN.
STORE_FAILED: Final = 0
STORE_PRESENT: Final = 1
STORE_WRITTEN: Final = 2
STEP_NAMES: Final = {1: "open", 2: "write", 3: "fsync", 4: "rename", 5: "stat"}
STEP_OPEN: Final = 1
_STEP_READ: Final = 2  # a load's
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
KIND_STORE: Final = 0
KIND_LOAD: Final = 1


def _fold_keys() -> Iterator[str]:
    """``FOLD_<D>_LO`` and ``FOLD_<D>_HI``: x^(D+32) and x^(D-32) mod P (CRC-32C), bit-reflected
    over 33 bits, for folding 16-byte lanes D bits forward (``crc_fold``)."""
    yield "/* CRC-32C folding keys, generated from Python. */"
    for distance in (2048, 512, 128):
        for half, power in (("LO", distance + 32), ("HI", distance - 32)):
            yield f"#define FOLD_{distance}_{half} 0x{_reflected_power(power):x}ULL"


def _reflected_power(power: int) -> int:
    """x^power mod the CRC-32C polynomial, its 33 bits reversed (bit 32 - j holds x^j)."""
    poly, value = 0x11EDC6F41, 1
    for _ in range(power):
        value <<= 1
        if value >> 32:
            value ^= poly
    return int(f"{value:033b}"[::-1], 2)


def _c_codes() -> Iterator[str]:
    yield "/* Result codes, steps and batch kinds, generated from Python. */"
    codes = {
        "STORE_PRESENT": STORE_PRESENT,
        "STORE_WRITTEN": STORE_WRITTEN,
        **{f"STEP_{name.upper()}": step for step, name in STEP_NAMES.items()},
        "STEP_READ": _STEP_READ,
        "LOAD_MISSING": LOAD_MISSING,
        "LOAD_OK": LOAD_OK,
        "LOAD_SHORT": LOAD_SHORT,
        "LOAD_BAD_HEADER": LOAD_BAD_HEADER,
        "LOAD_FOREIGN": LOAD_FOREIGN,
        "LOAD_BAD_LENGTH": LOAD_BAD_LENGTH,
        "LOAD_WRONG_KEY": LOAD_WRONG_KEY,
        "LOAD_BAD_PAYLOAD": LOAD_BAD_PAYLOAD,
        "LOAD_BAD_SIZE": LOAD_BAD_SIZE,
        "KIND_STORE": KIND_STORE,
        "KIND_LOAD": KIND_LOAD,
    }
    for name, value in codes.items():
        yield f"#define {name} {value}"


HEADER: Final = Path(__file__).with_name("_fsio_defs.h")


def generated_header() -> str:
    """What ``_fsio_defs.h`` (beside this file, included by ``_fsio.c``) must hold: the
    lines generated from Python. ``python -m kvtier_async.tiers.fs.native_source`` writes it;
    `tests/test_native.py` fails when the checked-in file differs."""
    return "\n".join([
        "/* Generated from Python by kvtier_async.tiers.fs.native_source.generated_header(): do",
        "   not edit; tests/test_native.py checks it is current (its message says how to",
        "   write it again). */",
        "#ifndef KVTIER_FSIO_DEFS_H",
        "#define KVTIER_FSIO_DEFS_H",
        c_defines(), *_c_codes(), *_fold_keys(),
        "#endif",
        "",
    ])  # fmt: skip


if __name__ == "__main__":
    HEADER.write_text(generated_header())
    print(f"wrote {HEADER}")
