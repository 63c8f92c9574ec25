"""The local SSD cache: size-bounded, shared by every DataLoader worker, rank and job on a node.

One directory holds a SQLite index whose schema blobdata owns (``cache.db``, WAL mode, process-safe;
see :mod:`.db`) and the values:
appended to pack files, one per writing process (``pk/<random>.pack``, see :mod:`.packs`: creating
a file per object cost more than everything else a put does), or, on a filesystem that cannot
punch holes, one value file per object under 256 subfolders (``ab/<random>-<size>-<checksum>.val``).
Small values live inline in the index (below 8 KiB where there are packs, 32 KiB where values are
files: ``values.MIN_PACKED_SIZE``, ``values.MIN_FILE_SIZE``). The key is the object URL plus its
identity (ETag, generation, version), so a changed object is a miss and its stale entry is replaced.

Safety
  * Bytes only: the index holds keys, value locations and small values with their checksums, never
    an object; :class:`~.values.Values` returns bytes and refuses every row it did not write (a file
    name outside the cache, no value), so a tampered row is a counted miss. Nothing in blobdata can
    unpickle (diskcache, the index's first layout, unpickles by default: CVE-2025-69872).
  * Every value carries a CRC32C (or zlib CRC32) checksum, kept in the index row (the file name),
    checked on every read; a mismatch, a short file or a missing file is a miss, the entry is
    deleted and counted as ``corrupt``, so the caller refetches.
  * Atomic writes: a value is appended to the writer's own pack (or written to ``<name>.tmp`` and
    renamed), and only then is its row inserted, so no reader ever sees a partial entry, even
    after SIGKILL. Values are not fsynced: after a power loss a torn value fails its checksum and
    is refetched. Orphans (temp files, value files without a row, pack ranges no row names in
    packs nobody owns, packs without rows) older than ``orphan_grace`` are swept at most once per
    grace period per directory, when a cache opens, examining at most 20,000 value files.
  * Directory mode 0700, every file 0600 (the index is created 0600 before SQLite opens it, and
    SQLite gives its -wal and -shm files the index's mode); the process umask is never changed.
  * Fork and spawn: the SQLite connection is opened lazily per process (:mod:`blobdata._process`). The
    forking thread's connection is closed just before ``os.fork()`` (so the child inherits no
    SQLite lock state); any other inherited one is abandoned, never used, in the child. A pickled
    cache is just ``(directory, size_limit, policy)`` and reopens on first use.
  * The index file is never opened outside SQLite once it exists: closing any descriptor of it
    would drop this process's SQLite locks and corrupt concurrent reads.

Size bound
  ``volume_bytes`` = value bytes (in packs: rounded up to 4 KiB blocks, what they take on disk) +
  SQLite index pages. Admission (``"admit"``) or eviction
  (``"lru"``) is decided and the row inserted in one ``BEGIN IMMEDIATE`` transaction, so any
  number of concurrent writers keeps ``volume_bytes <= size_limit + SLACK_BYTES`` (64 KiB: the
  index pages one insert can add after the check). On disk, the SQLite ``-wal`` and ``-shm``
  files come on top, and so does the tail of index pages freed since the last checkpoint (WAL mode
  truncates the index file only then), together <= ``WAL_SLACK_BYTES`` (4 MiB: a put that finds
  the WAL above 2 MiB checkpoints and truncates it), plus crash orphans until swept, block
  rounding of value files, and filesystem metadata (ext4: a 4 KiB extent block per pack with holes).

Policies
  ``"admit"`` (default): once full, keep what is cached and admit nothing new. Under a fresh
  random permutation each epoch this hits ``cache/dataset``, the optimum (CoorDL, VLDB 2021);
  ``get`` then never writes to SQLite. ``"lru"``: evict least-recently-used entries to make
  room; every hit updates an access time.

Failures never stop training: ``put`` returns False on any I/O error (ENOSPC, EDQUOT, EIO,
EFBIG, permissions, a locked index), logs one warning naming the directory, and skips writes for
``write_pause`` seconds; ``get`` turns read errors into misses. Counters in :meth:`stats` are
per process (each worker counts its own); volume and entries come from the shared index.

Trust: a cache is used only if its directory and index are the opening user's alone (:mod:`.trust`);
its size bound is stored in it and changes only upwards unless shrunk on purpose (:mod:`.trim`).
"""

from .cache import BlobCache, CacheStats
from .index import SLACK_BYTES, WAL_SLACK_BYTES, Policy
from .trim import DEFAULT_LIMIT, MIN_LIMIT, parse_limit
from .values import DB_NAME, checksum, verify
from .writer import CacheWriter

__all__ = [
    "DB_NAME",
    "DEFAULT_LIMIT",
    "MIN_LIMIT",
    "SLACK_BYTES",
    "WAL_SLACK_BYTES",
    "BlobCache",
    "CacheStats",
    "CacheWriter",
    "Policy",
    "checksum",
    "parse_limit",
    "verify",
]
