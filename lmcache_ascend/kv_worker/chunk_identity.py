"""What the bytes of a stored chunk are: a digest of the chunk layout and of the model.

LMCache keys a chunk by model name, world size, worker id, token-chunk hash and
KV dtype. Two engines that agree on those but lay the chunk's bytes out
differently (other KV-cache groups, hybrid manager on or off, bundled or
exploded planes, skipped state groups, block sizes, plane dtypes, chunk size)
or serve other weights under the same model path would read each other's
chunks as their own. `chunk_identity_digest` names both in a short hex string
that the connector folds into the model name of every key (`keyed_model_name`),
so such engines never see each other's chunks, and identical engines (same
plan, same model files) always do.

The layout part is the planner's own description: the scheduler groups' specs,
each layer group with its format, layer names and planes (scheduler group, row
bytes, block size, dtype, head, folded views), and the byte plan of a full
chunk. Placement that does not change the bytes (number of blocks, strides) is
left out.

The model part (`model_identity`) is the model's config and, per weights file,
its name, size and an xxh3-128 digest of every byte of it (header and tensor data
alike), so weights changed anywhere, even in place at the same path with the same
shapes and size (one projection of one layer redrawn), give another identity. A
sample of the file would miss such a change: an engine would then load chunks
computed with other weights. xxh3 is not cryptographic: it tells accidental
changes apart (a 128-bit digest), not crafted collisions; whoever can write the
weights files can change the outputs anyway.

Cost, measured on the 2-core development VM (random 1.5 GB file, 1 MiB reads):
xxh3-128 hashes at 12 GB/s in memory and 5.4-7 GB/s reading a file from the page
cache, which is where the weights are when the worker asks (vLLM has just loaded
them): 2.5-3 s for a 16 GB checkpoint. From a cold disk the read bounds it
(0.4-2 GB/s there: 8-40 s for 16 GB). SHA-256 (0.8 GB/s, 20 s warm) and BLAKE2b
(0.4-0.6 GB/s, 30-40 s) were measured and rejected; xxh3-64 is no faster than
xxh3-128 through a file. Sampling 16 windows of 4 KiB costs 0.07 ms a file but
misses every change between them. The tiny test checkpoints cost well under 10 ms
(a 256 KiB file 0.03 ms, 20 MB 6 ms). Each process hashes a file once: the digest
is kept in memory under its path and its (size, mtime_ns, ctime_ns, inode,
device), so a file rewritten in place (a new ctime even where the mtime is put
back) is hashed again.

Pure logic: the standard library and `xxhash` (values are described by the caller's objects).
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

import xxhash

__all__ = [
    "DIGEST_HEX_CHARS",
    "KEY_SEPARATOR",
    "chunk_identity_digest",
    "keyed_model_name",
    "model_identity",
    "plan_description",
]

DIGEST_HEX_CHARS = 16  # 64 bits of SHA-256
# Between LMCache's model name and the digest. LMCache joins key fields with "@" and
# tags with "%" (and parses them back), and file backends turn "/" into a separator:
# none of those may appear.
KEY_SEPARATOR = "+ascend-"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_READ_BYTES = 1 << 20  # per read: as fast as 8 MiB through the page cache, and cheap for tiny files


def _canonical(value: Any) -> Any:
    """JSON-encodable form of `value`: dataclass-free, with every non-basic value as its str()."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(key): _canonical(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(item) for item in value]
    if isinstance(value, enum.Enum):
        return _canonical(value.value)
    return str(value)


def _encoded(value: Any) -> bytes:
    return json.dumps(_canonical(value), sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def plan_description(planner: Any) -> dict:
    """The byte-relevant description of a `kv_worker.ChunkPlanner` (what two engines must share to share chunks)."""
    groups = {
        index: {
            "spec": spec.spec_class_name,
            "block_size": spec.block_size,
            "compress_ratio": spec.compress_ratio,
            "sliding_window": spec.sliding_window,
            "is_state": spec.is_state,
            "transferred": spec.transferred,
            # (only where the group's layers compress at several ratios: other groups keep their keys)
            **({"layer_ratios": [list(pair) for pair in spec.layer_ratios]} if spec.layer_ratios else {}),
        }
        for index, spec in sorted(planner.geometry_by_group.items())
    }
    layer_groups = [
        {
            "index": group.index,
            "format": group.format,
            "layers": list(group.member_names),
            "planes": [
                {
                    "scheduler_group": plane.scheduler_group,
                    "row_bytes": plane.row_bytes,
                    "block_size": plane.block_size,
                    "dtype": plane.dtype,
                    **({"compress_ratio": plane.compress_ratio} if plane.compress_ratio is not None else {}),
                }
                for plane in group.planes
            ],
        }
        for group in planner.layer_groups
    ]
    full = planner.full_plan
    regions = [
        {
            "layer_group": region.layer_group,
            "byte_offset": region.byte_offset,
            "row_bytes": list(region.regions.row_bytes),
            "rows": list(region.regions.region_rows),
            "plane_offsets": list(region.regions.plane_offsets),
            "layer_stride": region.regions.layer_stride,
            "layers": region.regions.layer_count,
        }
        for region in full.regions
    ]
    return {
        "chunk_size": planner.chunk_size,
        "groups": groups,
        "layer_groups": layer_groups,
        "full_chunk": {"regions": regions, "total_bytes": full.total_bytes},
    }


# Per resolved path: (the file's stamp when hashed, its identity). One entry per weights file seen.
_file_identities: dict[str, tuple[tuple[int, ...], dict]] = {}


def _hash_file(path: Path) -> str:
    """xxh3-128 of every byte of the file at `path`, hex."""
    digest = xxhash.xxh3_128()
    buffer = bytearray(_READ_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while read := handle.readinto(buffer):
            digest.update(view[:read])
    return digest.hexdigest()


def _stamp(path: Path) -> tuple[int, ...]:
    """What changes when the file at `path` is written or replaced: (size, mtime_ns, ctime_ns, inode, device)."""
    status = os.stat(path)
    return status.st_size, status.st_mtime_ns, status.st_ctime_ns, status.st_ino, status.st_dev


def _file_identity(path: Path) -> dict:
    """{size, xxh3_128 of the whole file}; hashed once per process while the file's stamp holds."""
    stamp = _stamp(path)
    key = str(path.resolve())
    kept = _file_identities.get(key)
    if kept is not None and kept[0] == stamp:
        return dict(kept[1])
    identity = {"size": stamp[0], "xxh3_128": _hash_file(path)}
    if _stamp(path) == stamp:  # a file written while it was read is hashed again by the next caller
        _file_identities[key] = (stamp, identity)
    return dict(identity)


def model_identity(model: str, config: Mapping[str, Any] | None = None, revision: str | None = None) -> dict:
    """The model's config and each weights file's size and whole-file digest under `model` (a local directory).

    A local directory's ``config.json`` replaces `config`. A `model` that is not a
    local directory (e.g. a hub id) is identified by its name, `revision` and
    `config` only; the result says so (``"weights": None``).
    """
    weights: dict[str, dict] | None = None
    directory = Path(model) if model else None
    if directory is not None and directory.is_dir():
        config_file = directory / "config.json"
        if config_file.is_file():  # the file as written, not as the installed library re-renders it
            config = json.loads(config_file.read_text())
        weights = {}
        for path in sorted(directory.rglob("*")):
            if path.suffix in WEIGHT_SUFFIXES and path.is_file():
                weights[path.relative_to(directory).as_posix()] = _file_identity(path)
    return {"revision": revision, "config": dict(config or {}), "weights": weights}


def chunk_identity_digest(plan: Mapping[str, Any], model: Mapping[str, Any]) -> str:
    """Hex digest of a chunk plan description and a model identity (equal in every process and host)."""
    digest = hashlib.sha256()
    digest.update(b"lmcache-ascend chunk identity v2\0")
    digest.update(_encoded(plan))
    digest.update(b"\0")
    digest.update(_encoded(model))
    return digest.hexdigest()[:DIGEST_HEX_CHARS]


def keyed_model_name(model_name: str, digest: str) -> str:
    """LMCache's model name with `digest` folded in; a name already carrying a digest gets the new one."""
    if not isinstance(digest, str) or len(digest) != DIGEST_HEX_CHARS or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError(f"digest={digest!r} is not allowed; it must be {DIGEST_HEX_CHARS} lowercase hex characters")
    base = model_name.split(KEY_SEPARATOR, 1)[0]
    return f"{base}{KEY_SEPARATOR}{digest}"
