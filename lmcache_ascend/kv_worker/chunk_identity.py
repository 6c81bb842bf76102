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

The model part (`model_identity`) is cheap at start: the model's config, and
per weights file its name, size, header (safetensors: the JSON header that
lists every tensor's name, dtype, shape and offsets) and SHA-256 of
`SAMPLE_COUNT` windows of `SAMPLE_BYTES` spread evenly over the file, so
re-drawn or retrained weights with the same shapes differ too.

Pure logic: standard library only (values are described by the caller's objects).
"""

from __future__ import annotations

import enum
import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

__all__ = [
    "DIGEST_HEX_CHARS",
    "KEY_SEPARATOR",
    "SAMPLE_BYTES",
    "SAMPLE_COUNT",
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
SAMPLE_COUNT = 16
SAMPLE_BYTES = 4096
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_HEADER_LIMIT = 100 << 20  # a safetensors header larger than this is not one


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


def _safetensors_header(handle, size: int) -> bytes | None:
    if size < 8:
        return None
    length = int.from_bytes(handle.read(8), "little")
    if length <= 0 or length > min(size - 8, _HEADER_LIMIT):
        return None
    header = handle.read(length)
    return header if header[:1] == b"{" else None


def _file_identity(path: Path) -> dict:
    size = path.stat().st_size
    with open(path, "rb") as handle:
        header = _safetensors_header(handle, size) if path.suffix == ".safetensors" else None
        start = 8 + len(header) if header is not None else 0
        sampled = hashlib.sha256()
        span = size - start
        if span > 0:
            count = min(SAMPLE_COUNT, max(1, span // SAMPLE_BYTES))
            for index in range(count):
                # Evenly spread windows, the first at the data's start and the last at its end.
                offset = start + (span - SAMPLE_BYTES) * index // max(1, count - 1) if span > SAMPLE_BYTES else start
                handle.seek(offset)
                sampled.update(handle.read(SAMPLE_BYTES))
    return {
        "size": size,
        "header_sha256": hashlib.sha256(header).hexdigest() if header is not None else None,
        "samples_sha256": sampled.hexdigest(),
    }


def model_identity(model: str, config: Mapping[str, Any] | None = None, revision: str | None = None) -> dict:
    """The model's config and a fingerprint of each weights file found under `model` (a local directory).

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
    digest.update(b"lmcache-ascend chunk identity v1\0")
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
