"""Operations on what the tiers leave behind: the ``kvtier inspect``, ``gc`` and ``regions``
commands (`kvtier_async.cli` parses their arguments and prints; the work is here).

- `layout`: what a root holds, by name (namespaces, ranks, blocks, temporaries), the verdict
  on one block file, and the fs tier's own eviction order; the same for a directory and a
  bucket.
- `fsroot`: an fs tier root: walk, verify, repair, GC (blocking code).
- `s3root`: a bucket prefix, through the obj tier's client and request layer (asyncio).
- `regions`: the CPU tier's shared regions in ``/dev/shm``: owners, liveness, stale ones.
- `results`: what the operations return; `render`: text, JSON, the progress line, sizes.

Everything here is safe on a root or a region directory that live instances are using: see
each module's docstring for how.
"""
