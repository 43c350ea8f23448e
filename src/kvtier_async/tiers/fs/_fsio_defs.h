/* Generated from Python by kvtier_async.tiers.fs.native_source.generated_header(): do
   not edit; tests/test_native.py checks it is current (its message says how to
   write it again). */
#ifndef KVTIER_FSIO_DEFS_H
#define KVTIER_FSIO_DEFS_H
/* The block file layout, generated from kvtier_async.tiers.blockfile. */
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "block files are little-endian; this helper writes sums in host order"
#endif
#define KVB_HEADER_BYTES 4096
#define KVB_FIELDS_BYTES 56
#define KVB_HEADER_SUM_AT 4088
#define KVB_HEADER_SUM_SIZE 8
#define KVB_MAGIC_AT 0
#define KVB_MAGIC_SIZE 8
#define KVB_VERSION_AT 8
#define KVB_VERSION_SIZE 2
#define KVB_RESERVED_AT 10
#define KVB_RESERVED_SIZE 2
#define KVB_HEADER_BYTES_AT 12
#define KVB_HEADER_BYTES_SIZE 4
#define KVB_PAYLOAD_BYTES_AT 16
#define KVB_PAYLOAD_BYTES_SIZE 8
#define KVB_PAYLOAD_SUM_AT 24
#define KVB_PAYLOAD_SUM_SIZE 8
#define KVB_KEY_SUM_AT 32
#define KVB_KEY_SUM_SIZE 8
#define KVB_CHECKSUM_NAME_AT 40
#define KVB_CHECKSUM_NAME_SIZE 16
#define KVB_DIFFERS_FORMAT(h, w) (memcmp((h) + KVB_MAGIC_AT, (w) + KVB_MAGIC_AT, KVB_MAGIC_SIZE) || memcmp((h) + KVB_VERSION_AT, (w) + KVB_VERSION_AT, KVB_VERSION_SIZE) || memcmp((h) + KVB_HEADER_BYTES_AT, (w) + KVB_HEADER_BYTES_AT, KVB_HEADER_BYTES_SIZE) || memcmp((h) + KVB_CHECKSUM_NAME_AT, (w) + KVB_CHECKSUM_NAME_AT, KVB_CHECKSUM_NAME_SIZE))
#define KVB_DIFFERS_LENGTH(h, w) (memcmp((h) + KVB_PAYLOAD_BYTES_AT, (w) + KVB_PAYLOAD_BYTES_AT, KVB_PAYLOAD_BYTES_SIZE))
#define KVB_DIFFERS_KEY(h, w) (memcmp((h) + KVB_KEY_SUM_AT, (w) + KVB_KEY_SUM_AT, KVB_KEY_SUM_SIZE))

/* Result codes, steps and batch kinds, generated from Python. */
#define STORE_PRESENT 1
#define STORE_WRITTEN 2
#define STEP_OPEN 1
#define STEP_WRITE 2
#define STEP_FSYNC 3
#define STEP_RENAME 4
#define STEP_STAT 5
#define STEP_READ 2
#define LOAD_MISSING 0
#define LOAD_OK 1
#define LOAD_SHORT 10
#define LOAD_BAD_HEADER 11
#define LOAD_FOREIGN 12
#define LOAD_BAD_LENGTH 13
#define LOAD_WRONG_KEY 14
#define LOAD_BAD_PAYLOAD 15
#define LOAD_BAD_SIZE 16
#define KIND_STORE 0
#define KIND_LOAD 1
/* CRC-32C folding keys, generated from Python. */
#define FOLD_2048_LO 0xdcb17aa4ULL
#define FOLD_2048_HI 0xb9e02b86ULL
#define FOLD_512_LO 0x740eef02ULL
#define FOLD_512_HI 0x9e4addf8ULL
#define FOLD_128_LO 0xf20c0dfeULL
#define FOLD_128_HI 0x14cd00bd6ULL
#endif
