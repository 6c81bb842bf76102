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
from lmcache_ascend.kv_worker.formats import KVFormat
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
    assert rewritten["weights"]["model.safetensors"]["header_sha256"] == first["weights"]["model.safetensors"]["header_sha256"]
    assert rewritten != first
    assert _digest(_planner(), rewritten) != _digest(_planner(), first)

    other_config = model_identity(str(_write_checkpoint(tmp_path / "b", values, {"hidden_size": 256})))
    assert other_config["weights"] == first["weights"] and other_config != first


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
