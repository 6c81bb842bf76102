"""The chunk identity digest: equal for equal plans and models in every process, different for any change."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_ascend.kv_worker.chunk_identity import (
    DIGEST_HEX_CHARS,
    KEY_SEPARATOR,
    chunk_identity_digest,
    keyed_model_name,
    model_identity,
    plan_description,
)
from lmcache_ascend.kv_worker.chunk_plan import ChunkPlanner
from lmcache_ascend.kv_worker.layer_planes import KVFormat
from lmcache_ascend.kv_worker.groups import LayerGroup, PlaneIdentity
from lmcache_ascend.multigroup.specs import KVGroupSpec

REPO_ROOT = Path(__file__).resolve().parents[2]


def _planner(*, chunk_size=256, row_bytes=(256, 256), dtype="float32", window=128, block_size=128,
             layers=(("l0",), ("l1",)), skip_second=False, fmt=KVFormat.MERGED) -> ChunkPlanner:
    import torch

    geometry = {
        0: KVGroupSpec(0, "SlidingWindowSpec", block_size=block_size, sliding_window=window),
        1: KVGroupSpec(1, "FullAttentionSpec", block_size=block_size, transferred=not skip_second),
    }
    groups = [
        LayerGroup(
            index=index,
            format=fmt,
            planes=(PlaneIdentity(index, row_bytes[index], block_size, getattr(torch, dtype)),),
            member_names=layers[index],
            paged_rows=(),
            plane_geometries=(),
        )
        for index in ((0,) if skip_second else (0, 1))
    ]
    return ChunkPlanner(groups, geometry, chunk_size)


def _digest(planner, model=None) -> str:
    return chunk_identity_digest(plan_description(planner), model or {"revision": None, "config": {}, "weights": None})


def test_equal_plans_give_equal_digests_and_the_digest_is_short_hex():
    first, second = _digest(_planner()), _digest(_planner())
    assert first == second
    assert len(first) == DIGEST_HEX_CHARS and all(c in "0123456789abcdef" for c in first)


@pytest.mark.parametrize(
    "change",
    [
        dict(chunk_size=512),
        dict(row_bytes=(256, 512)),
        dict(dtype="bfloat16"),
        dict(window=64),
        dict(block_size=64),
        dict(layers=(("l1",), ("l0",))),
        dict(skip_second=True),
        dict(fmt=KVFormat.SEPARATE),
    ],
    ids=lambda change: next(iter(change)),
)
def test_each_layout_change_changes_the_digest(change):
    assert _digest(_planner(**change)) != _digest(_planner())


def test_the_digest_is_the_same_in_another_process():
    description = plan_description(_planner())
    code = (
        "import json, sys; from lmcache_ascend.kv_worker.chunk_identity import chunk_identity_digest; "
        "print(chunk_identity_digest(json.loads(sys.argv[1]), {'revision': None, 'config': {}, 'weights': None}))"
    )
    from lmcache_ascend.kv_worker.chunk_identity import _canonical

    for seed in ("0", "12345"):  # Python's salted hash() must play no part
        out = subprocess.run(
            [sys.executable, "-c", code, json.dumps(_canonical(description))],
            cwd=REPO_ROOT, env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)},
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        assert out == _digest(_planner())


def _write_checkpoint(directory: Path, values: bytes, config: dict | None = None) -> Path:
    """A safetensors-shaped file: 8-byte header length, JSON header, data."""
    directory.mkdir(parents=True, exist_ok=True)
    header = json.dumps({"w": {"dtype": "F32", "shape": [len(values) // 4], "data_offsets": [0, len(values)]}}).encode()
    (directory / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + values)
    (directory / "config.json").write_text(json.dumps(config or {"hidden_size": 128}))
    return directory


def test_model_identity_follows_the_weights_not_the_path(tmp_path):
    values = bytes(range(256)) * 1024  # 256 KiB: more than the sampled windows
    first = model_identity(str(_write_checkpoint(tmp_path / "a", values)))
    copied = tmp_path / "copy"
    shutil.copytree(tmp_path / "a", copied)
    assert model_identity(str(copied)) == first, "a copy of the same files (other path, other mtime) must share"
    assert first["weights"] and set(first["weights"]) == {"model.safetensors"}

    # Same shapes, same header, same size, other values: rewritten in place.
    rewritten = model_identity(str(_write_checkpoint(tmp_path / "a", bytes(reversed(values)))))
    assert rewritten["weights"]["model.safetensors"]["size"] == first["weights"]["model.safetensors"]["size"]
    assert rewritten != first
    assert _digest(_planner(), rewritten) != _digest(_planner(), first)

    other_config = model_identity(str(_write_checkpoint(tmp_path / "b", values, {"hidden_size": 256})))
    assert other_config["weights"] == first["weights"] and other_config != first


def _checkpoint_of_projections(directory: Path, layers: int, tensor_bytes: int, redrawn: dict[int, bytes]) -> Path:
    """A safetensors checkpoint of k_proj and v_proj per layer (ramp values); `redrawn`: bytes put at
    these offsets of the data (the same size, shapes and header)."""
    directory.mkdir(parents=True, exist_ok=True)
    names = [f"model.layers.{layer}.self_attn.{proj}.weight" for layer in range(layers) for proj in ("k_proj", "v_proj")]
    header = json.dumps({
        name: {"dtype": "F16", "shape": [tensor_bytes // 2], "data_offsets": [i * tensor_bytes, (i + 1) * tensor_bytes]}
        for i, name in enumerate(names)
    }).encode()
    data = bytearray(bytes(range(251)) * (len(names) * tensor_bytes // 251 + 1))[: len(names) * tensor_bytes]
    for offset, replacement in redrawn.items():
        data[offset: offset + len(replacement)] = replacement
    (directory / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(data))
    (directory / "config.json").write_text(json.dumps({"hidden_size": 128}))
    return directory


def _sampled_windows(size: int, start: int, count: int = 16, window: int = 4096) -> list[range]:
    """The file ranges an identity reading `count` evenly spread windows of the data would read."""
    span = size - start
    return [range(start + (span - window) * i // (count - 1), start + (span - window) * i // (count - 1) + window)
            for i in range(count)]


def test_bytes_changed_between_sampled_windows_change_the_identity(tmp_path):
    """K/V projections of three layers redrawn in the middle of their tensors, nowhere near the
    evenly spread windows a sampling identity reads: another checkpoint, another identity."""
    tensor_bytes, file = 64 << 10, "model.safetensors"
    plain = _checkpoint_of_projections(tmp_path / "plain", 8, tensor_bytes, {})
    raw_plain = (plain / file).read_bytes()
    start = 8 + int.from_bytes(raw_plain[:8], "little")
    windows = _sampled_windows(len(raw_plain), start)
    redrawn_at = {}
    for layer in (1, 4, 6):  # from the middle of the layer's k_proj and v_proj on, the first spot no window reads
        for tensor in (2 * layer, 2 * layer + 1):
            offset = tensor * tensor_bytes + tensor_bytes // 2
            while any(start + offset + i in window for window in windows for i in (0, 15)):
                offset += 1024
            assert offset + 16 <= (tensor + 1) * tensor_bytes
            redrawn_at[offset] = b"\x13\x37" * 8
    redrawn = _checkpoint_of_projections(tmp_path / "redrawn", 8, tensor_bytes, redrawn_at)

    raw_redrawn = (redrawn / file).read_bytes()
    assert len(raw_plain) == len(raw_redrawn) and raw_plain != raw_redrawn
    assert raw_plain[:start] == raw_redrawn[:start], "the header (names, shapes, offsets) is the same"
    differing = [i for i in range(len(raw_plain)) if raw_plain[i] != raw_redrawn[i]]
    assert not any(i in window for i in differing for window in windows), "a change a sample would have seen"

    first, second = model_identity(str(plain)), model_identity(str(redrawn))
    assert first["config"] == second["config"] and first["weights"][file]["size"] == second["weights"][file]["size"]
    assert first != second
    assert _digest(_planner(), first) != _digest(_planner(), second)


def test_a_file_is_hashed_once_per_process_until_it_changes(tmp_path, monkeypatch):
    import os

    from lmcache_ascend.kv_worker import chunk_identity

    directory = _checkpoint_of_projections(tmp_path / "m", 2, 16 << 10, {})
    hashed = []
    real_hash = chunk_identity._hash_file
    monkeypatch.setattr(chunk_identity, "_hash_file", lambda path: hashed.append(path) or real_hash(path))

    first = model_identity(str(directory))
    assert model_identity(str(directory)) == first, "the same file read twice gives the same identity"
    assert len(hashed) == 1, "the second read came from the process's memory"
    monkeypatch.setattr(chunk_identity, "_file_identities", {})
    assert model_identity(str(directory)) == first and len(hashed) == 2, "hashed again: the same identity"

    # Rewritten in place, same size, its mtime put back: the inode and size hold, the ctime does not.
    path = directory / "model.safetensors"
    before = os.stat(path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    with open(path, "r+b") as handle:
        handle.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert model_identity(str(directory)) != first and len(hashed) == 3


def test_model_identity_of_a_hub_name_has_no_weights():
    identity = model_identity("org/not-a-local-dir", {"hidden_size": 1}, "main")
    assert identity == {"revision": "main", "config": {"hidden_size": 1}, "weights": None}
    assert model_identity("", None, None)["weights"] is None  # never the working directory


def test_keyed_model_name_keeps_lmcache_key_separators_out_and_rekeys():
    digest = _digest(_planner())
    name = keyed_model_name("/models/gemma", digest)
    assert name == f"/models/gemma{KEY_SEPARATOR}{digest}"
    added = name[len("/models/gemma"):]
    assert not set(added) & set("@%/"), "LMCache parses keys on '@' and '%'; file backends split on '/'"
    other = _digest(_planner(chunk_size=512))
    assert keyed_model_name(name, other) == f"/models/gemma{KEY_SEPARATOR}{other}"


@pytest.mark.parametrize("bad", ["", "ABCDEF0123456789", "0123", 7])
def test_keyed_model_name_refuses_a_bad_digest(bad):
    with pytest.raises(ValueError, match="digest=.*lowercase hex"):
        keyed_model_name("m", bad)


def test_plan_description_is_json_and_ignores_placement():
    description = plan_description(_planner())
    json.dumps(copy.deepcopy(description), default=str)
    assert description["full_chunk"]["total_bytes"] == _planner().full_plan.total_bytes
