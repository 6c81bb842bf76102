"""The hole-mode glue on LMCache's real engine and blender.

The engine is a real ``LMCacheEngine`` (CPU storage, layerwise, blending,
real ``SegmentTokenDatabase`` with a tiny tokenizer).  The only stand-ins:
the layerwise device connector (it moves KV between CPU and CUDA/NPU memory,
so it records what it is given instead), and, for the blender, the vLLM
model (``LMCBlender`` reads only each layer's ``rotary_emb``; weights are
the tiny reference model's RoPE).
"""

from __future__ import annotations

import types

import pytest
import torch

from lmcache_ascend.blend.segments import lookup_from_ranges
from lmcache_ascend.patches import State, registry
from lmcache_ascend.patches.lmcache.blend_holes_blender import HOLE_STATE_ATTRIBUTE
from lmcache_ascend.patches.lmcache.blend_holes_engine import HOLE_SINK_KWARG

from tests.blend.lmcache_setup import HIDDEN, NUM_LAYERS, SEP, store_document_kv
from tests.patching import apply_now

REGISTRY = registry.process_registry()
ENGINE_PATCH = "lmcache-blend-holes-engine"
BLENDER_PATCH = "lmcache-blend-holes-blender"


@pytest.fixture
def hole_patches(monkeypatch):
    monkeypatch.setenv("LMCACHE_ASCEND_BLEND_HOLES", "1")
    states = {name: apply_now(REGISTRY, name) for name in (ENGINE_PATCH, BLENDER_PATCH)}
    assert states == {ENGINE_PATCH: State.APPLIED, BLENDER_PATCH: State.APPLIED}
    yield
    for name in (BLENDER_PATCH, ENGINE_PATCH):
        REGISTRY.revert(name)


def test_patches_are_off_by_default(monkeypatch):
    monkeypatch.delenv("LMCACHE_ASCEND_BLEND_HOLES", raising=False)
    for name in (ENGINE_PATCH, BLENDER_PATCH):
        assert apply_now(REGISTRY, name) is State.SKIPPED_DISABLED
        assert REGISTRY.state(name) is State.SKIPPED_DISABLED


class RecordingLayerwiseConnector:
    """Stands in for LMCache's CUDA/NPU layerwise connector: same generator
    protocol as ``batched_to_gpu``, records the ranges and per-layer data."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def batched_to_gpu(self, starts, ends, **kwargs):
        call = {"starts": list(starts), "ends": list(ends), "kwargs": kwargs, "layers": []}
        self.calls.append(call)
        for _ in range(NUM_LAYERS):
            memory_objs = yield
            call["layers"].append([obj.tensor.clone() for obj in memory_objs])
        yield
        yield


def store_document(engine, document: list[int], marker: float) -> None:
    """Put a document's KV (every element = marker + layer) into LMCache."""
    layers = [torch.full((2, len(document), HIDDEN), marker + layer) for layer in range(NUM_LAYERS)]
    store_document_kv(engine, document, layers)


def rag_prompt(*documents: list[int]) -> list[int]:
    tokens: list[int] = []
    for index, document in enumerate(documents):
        tokens += (SEP if index else []) + document
    return tokens


# Documents: token ids 3..12 are words "0".."9" of the tiny tokenizer.
SYSTEM, DOC_A, DOC_B, DOC_C, MISSING = [3, 4, 5], [6, 6, 7, 7], [8, 9], [10, 11, 12], [5, 5, 5]


@pytest.fixture(scope="module")
def stored(engine):
    for marker, document in ((100.0, SYSTEM), (200.0, DOC_A), (300.0, DOC_B), (400.0, DOC_C)):
        store_document(engine, document, marker)


def test_lookup_reports_cached_documents_after_a_hole(engine, stored, hole_patches):
    tokens = rag_prompt(SYSTEM, DOC_A, MISSING, DOC_B, DOC_C, MISSING)
    end_of_doc_c = len(rag_prompt(SYSTEM, DOC_A, MISSING, DOC_B, DOC_C))
    assert engine.lookup(tokens=tokens, lookup_id="req-1", pin=True) == end_of_doc_c
    pinned = [key for keys in engine.lookup_pins["req-1"].values() for key in keys]
    assert len(pinned) == 4 * NUM_LAYERS  # system, A, B, C: every layer of each
    engine.lookup_unpin("req-1")


def test_lookup_without_the_blender_side_or_tokens_is_upstream(engine, stored, hole_patches):
    tokens = rag_prompt(SYSTEM, DOC_A, MISSING, DOC_B)
    prefix = len(rag_prompt(SYSTEM, DOC_A))
    REGISTRY.revert(BLENDER_PATCH)  # engine side alone must not promise holes
    assert engine.lookup(tokens=tokens) == prefix
    assert apply_now(REGISTRY, BLENDER_PATCH) is State.APPLIED
    assert engine.lookup(tokens=tokens) == len(tokens)


@pytest.mark.parametrize(
    "documents, expected",
    [
        ([MISSING, DOC_A], 0),  # hole at the very start: prefilled from scratch
        ([SYSTEM, MISSING], len(SYSTEM)),  # hole at the very end
        ([MISSING], 0),  # all miss
        ([SYSTEM, DOC_A, DOC_B], len(rag_prompt(SYSTEM, DOC_A, DOC_B))),  # all hit
    ],
    ids=["hole-at-start", "hole-at-end", "all-miss", "all-hit"],
)
def test_lookup_edge_cases(engine, stored, hole_patches, documents, expected):
    assert engine.lookup(tokens=rag_prompt(*documents)) == expected


def test_lookup_is_unchanged_when_the_flag_is_off(engine, stored, monkeypatch):
    monkeypatch.delenv("LMCACHE_ASCEND_BLEND_HOLES", raising=False)
    assert apply_now(REGISTRY, ENGINE_PATCH) is State.SKIPPED_DISABLED
    tokens = rag_prompt(SYSTEM, DOC_A, MISSING, DOC_B)
    assert engine.lookup(tokens=tokens) == len(rag_prompt(SYSTEM, DOC_A))


def drain(generator) -> list:
    return list(generator)


def test_retrieve_layer_loads_every_cached_document_and_reports_the_lookup(engine, stored, hole_patches):
    connector = RecordingLayerwiseConnector()
    engine.gpu_connector = connector
    tokens = torch.tensor(rag_prompt(SYSTEM, MISSING, DOC_B, MISSING, DOC_A))
    received = []
    outputs = drain(
        engine.retrieve_layer(
            tokens,
            None,
            slot_mapping=torch.arange(len(tokens)),
            **{HOLE_SINK_KWARG: lambda lookup, start: received.append((lookup, start))},
        )
    )
    assert len(outputs) == NUM_LAYERS + 2  # the protocol LMCBlender.blend_layer drives
    (lookup, buffer_start), = received
    assert buffer_start == 0
    assert lookup.hit == (True, False, True, False, True)
    (call,) = connector.calls
    b_start = len(rag_prompt(SYSTEM, MISSING)) + 2
    a_start = len(rag_prompt(SYSTEM, MISSING, DOC_B, MISSING)) + 2
    assert call["starts"] == [0, b_start, a_start]
    assert call["ends"] == [3, b_start + 2, a_start + 4]
    assert HOLE_SINK_KWARG not in call["kwargs"]  # the sink never reaches the device side
    assert "slot_mapping" in call["kwargs"]
    for layer, objs in enumerate(call["layers"]):  # exactly the stored bytes, in prompt order
        assert [torch.unique(t).tolist() for t in objs] == [[100.0 + layer], [300.0 + layer], [200.0 + layer]]
    mask = outputs[-1]
    assert mask.tolist() == [i < 3 or b_start <= i < b_start + 2 or a_start <= i for i in range(len(tokens))]
    assert int(outputs[0]) == 3 + 2 + 4


def test_retrieve_layer_with_nothing_cached_does_not_crash(engine, stored, hole_patches):
    connector = RecordingLayerwiseConnector()
    engine.gpu_connector = connector
    received = []
    outputs = drain(
        engine.retrieve_layer(torch.tensor(MISSING), None, **{HOLE_SINK_KWARG: lambda *a: received.append(a)})
    )
    assert len(outputs) == NUM_LAYERS + 2 and connector.calls == []
    assert outputs[-1].tolist() == [False] * 3
    assert received[0][0].num_cached_tokens == 0


def test_retrieve_layer_without_a_sink_is_upstream(engine, stored, hole_patches):
    engine.gpu_connector = RecordingLayerwiseConnector()
    generator = engine.retrieve_layer(torch.tensor(rag_prompt(SYSTEM, DOC_A)), None)
    assert generator.gi_code.co_name != "_retrieve_layer_with_holes"
    # Upstream insists on one of its own device connectors (ours never checks):
    # reaching that check proves the call went to the original.
    with pytest.raises(AssertionError):
        drain(generator)
    assert engine.gpu_connector.calls == []


# ------------------------------------------------------------------ blender
class FakeBufferConnector:
    """The layerwise buffer the blender reads (``get_kv``): rows of the
    retrieved range, hole rows zero as LMCache's buffer connector leaves them."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.keys, self.values = keys, values

    def get_kv(self, layer_id: int):
        return self.keys[layer_id], self.values[layer_id]


def make_blender(connector, check_layers=(1,), ratio=0.25):
    """A real LMCBlender without its vLLM model (which needs a GPU and weights)."""
    from lmcache.v1.compute.blend.blender import LMCBlender
    from lmcache.v1.compute.blend.metadata import LMCBlendCommonMetadata, LMCBlendMetadata

    from tests.blend.reference.rope import RopeSpec, apply_rope

    spec = RopeSpec(head_dim=8)

    def rotary_emb(positions, q, k):
        shape_q, shape_k = q.shape, k.shape
        return (
            apply_rope(q.view(q.shape[0], -1, 8), positions, spec).view(shape_q),
            apply_rope(k.view(k.shape[0], -1, 8), positions, spec).view(shape_k),
        )

    layer = types.SimpleNamespace(self_attn=types.SimpleNamespace(rotary_emb=rotary_emb))
    blender = LMCBlender.__new__(LMCBlender)
    blender.gpu_connector = connector
    blender.layerwise_model = types.SimpleNamespace(
        vllm_model=types.SimpleNamespace(model=types.SimpleNamespace(layers=[layer] * NUM_LAYERS))
    )
    blender.num_layers = NUM_LAYERS
    blender.common_metadata = LMCBlendCommonMetadata(check_layers=list(check_layers), recomp_ratios=[ratio])
    blender.metadata = LMCBlendMetadata()
    return blender, rotary_emb


def attention_metadata(num_tokens: int):
    from lmcache.v1.compute.attention.metadata import LMCFlashAttnMetadata

    return LMCFlashAttnMetadata(
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, num_tokens], dtype=torch.int32),
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
    )


def test_blender_recomputes_holes_and_topk_and_writes_them_to_the_buffer(hole_patches):
    # 12 tokens: cached [0, 4) and [6, 12) (a two-token hole at 4..5).
    count = 12
    lookup = lookup_from_ranges(count, [(0, 4, True), (4, 6, False), (6, 12, True)])
    generator = torch.Generator().manual_seed(0)
    fresh = [(torch.randn(count, HIDDEN, generator=generator), torch.randn(count, HIDDEN, generator=generator))
             for _ in range(NUM_LAYERS)]
    q = torch.randn(count, HIDDEN, generator=generator)
    residual = torch.randn(count, HIDDEN, generator=generator)
    buffer_k = [torch.full((count, HIDDEN), float("nan")) for _ in range(NUM_LAYERS)]
    buffer_v = [torch.full((count, HIDDEN), float("nan")) for _ in range(NUM_LAYERS)]
    connector = FakeBufferConnector(buffer_k, buffer_v)
    blender, rotary = make_blender(connector, ratio=0.25)
    setattr(blender, HOLE_STATE_ATTRIBUTE, (lookup, 0))
    positions = torch.arange(count)

    # layer 0 (before the check layer): fresh KV for every token lands in the buffer
    k0, v0 = fresh[0]
    out = blender.process_qkv(q, k0, v0, residual, 0, None, attention_metadata(count))
    _, rotated_k0 = rotary(positions, q, k0)
    assert torch.equal(buffer_k[0], rotated_k0) and torch.equal(buffer_v[0], v0)
    assert out[1].shape[0] == count

    # layer 1 (check): cached K differs from fresh K by a known per-token amount
    k1, v1 = fresh[1]
    _, rotated_k1 = rotary(positions, q, k1)
    deviation = torch.tensor([0.0, 5.0, 1.0, 0.0, 0.0, 0.0, 0.0, 9.0, 0.0, 0.0, 3.0, 0.0])
    buffer_k[1].copy_(rotated_k1 - deviation[:, None])
    buffer_k[1][4:6] = 0.0  # holes are zeroed by LMCache's buffer connector
    buffer_v[1].fill_(-1.0)
    metadata = attention_metadata(count)
    q_sel, k_all, v_all, residual_sel, attn_out, metadata = blender.process_qkv(
        q, k1, v1, residual, 1, None, metadata
    )
    # holes 4, 5 always; budget int(0.25 * 4) = 1 of [0,4) -> token 1, int(0.25 * 6) = 1 of [6,12) -> token 7
    assert blender.metadata.imp_indices.tolist() == [1, 4, 5, 7]
    assert metadata.max_query_len == 4
    assert q_sel.shape[0] == residual_sel.shape[0] == attn_out.shape[0] == 4
    assert k_all is buffer_k[1]
    chosen = [1, 4, 5, 7]
    assert torch.equal(buffer_k[1][chosen], rotated_k1[chosen])
    assert torch.equal(buffer_v[1][chosen], v1[chosen])
    others = [i for i in range(count) if i not in chosen]
    assert torch.equal(buffer_v[1][others], torch.full((len(others), HIDDEN), -1.0))

    # layer 2: only the chosen tokens come in; they overwrite their rows
    k2, v2 = fresh[2]
    buffer_k[2].fill_(7.0)
    blender.process_qkv(q_sel, k2[chosen], v2[chosen], residual_sel, 2, attn_out, metadata)
    assert torch.isfinite(buffer_k[2]).all() and torch.isfinite(buffer_v[2][chosen]).all()
    assert torch.equal(buffer_k[2][others], torch.full((len(others), HIDDEN), 7.0))


def test_blender_without_a_hole_lookup_runs_upstream(hole_patches):
    count = 6
    old = torch.zeros(count, HIDDEN)
    connector = FakeBufferConnector([old.clone() for _ in range(NUM_LAYERS)], [old.clone() for _ in range(NUM_LAYERS)])
    blender, _ = make_blender(connector, ratio=0.5)
    k = torch.randn(count, HIDDEN)
    q = torch.randn(count, HIDDEN)
    result = blender.process_qkv(q, k, k.clone(), k.clone(), 1, None, attention_metadata(count))
    # upstream: top int(6 * 0.5) = 3 over ALL tokens, no hole notion
    assert blender.metadata.imp_indices.numel() == 3
    assert result[0].shape[0] == 3


def test_blend_layer_hands_the_engine_a_sink_only_if_it_accepts_one(hole_patches, engine):
    from lmcache.v1.compute.blend.blender import LMCBlender

    seen = []

    class Engine:
        def retrieve_layer(self, tokens, mask=None, **kwargs):
            seen.append(sorted(kwargs))
            yield from [None] * (NUM_LAYERS + 2)

    blender, _ = make_blender(None)
    blender.layerwise_model.compute_layer = lambda tokens: iter([None] * NUM_LAYERS)
    blender.cache_engine = Engine()  # a retrieve_layer without the hole marker
    setattr(blender, HOLE_STATE_ATTRIBUTE, ("stale", 0))
    LMCBlender.blend(blender, torch.tensor([1, 2, 3]), None, slot_mapping=None)
    assert seen == [["slot_mapping"]]
    assert getattr(blender, HOLE_STATE_ATTRIBUTE) is None  # a previous request's lookup never survives

    connector = RecordingLayerwiseConnector()
    engine.gpu_connector = connector
    blender.cache_engine = engine  # the patched real engine accepts the sink
    LMCBlender.blend(blender, torch.tensor(MISSING), None, slot_mapping=torch.arange(3))
    lookup, start = getattr(blender, HOLE_STATE_ATTRIBUTE)
    assert lookup.num_tokens == 3 and lookup.num_cached_tokens == 0 and start == 0


def test_retrieve_layer_refuses_a_leading_hole_instead_of_leaving_stale_kv(engine, stored, hole_patches):
    """Lookup reports 0 for a prompt whose first document misses; if the
    blender is still asked to load it (a pinned entry lost in between), the
    buffer would not cover the leading hole: a clear error, not stale KV."""
    engine.gpu_connector = RecordingLayerwiseConnector()
    tokens = torch.tensor(rag_prompt(MISSING, DOC_A))
    assert engine.lookup(tokens=tokens.tolist()) == 0
    with pytest.raises(RuntimeError, match=r"found cached documents only in \[5, 9\) but the first document starts at 0"):
        drain(engine.retrieve_layer(tokens, None, **{HOLE_SINK_KWARG: lambda *a: None}))
    assert engine.gpu_connector.calls == []


def test_blender_rejects_a_lookup_for_another_request(hole_patches):
    count = 4
    zeros = [torch.zeros(count, HIDDEN)] * NUM_LAYERS
    connector = FakeBufferConnector(zeros, zeros)
    blender, _ = make_blender(connector)
    setattr(blender, HOLE_STATE_ATTRIBUTE, (lookup_from_ranges(9, [(0, 9, True)]), 0))
    x = torch.zeros(count, HIDDEN)
    with pytest.raises(ValueError, match="retrieval covered 9 tokens but layer 0 computes 4"):
        blender.process_qkv(x, x, x, x, 0, None, attention_metadata(count))


def test_blender_with_a_buffer_starting_after_vllm_cached_tokens(hole_patches):
    """vLLM's prefix cache already holds tokens [0, 2): retrieval starts at 2,
    so LMCache's buffer covers [2, 8).  Those leading tokens count as holes
    (recomputed for attention), their keys still reach attention, and only
    buffer rows are written."""
    count, start = 8, 2
    lookup = lookup_from_ranges(count, [(2, 8, True)])
    buffer_k = [torch.zeros(count - start, HIDDEN) for _ in range(NUM_LAYERS)]
    buffer_v = [torch.zeros(count - start, HIDDEN) for _ in range(NUM_LAYERS)]
    blender, rotary = make_blender(FakeBufferConnector(buffer_k, buffer_v), ratio=0.5)
    setattr(blender, HOLE_STATE_ATTRIBUTE, (lookup, start))
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(count, HIDDEN, generator=generator) for _ in range(3))
    _, rotated_k = rotary(torch.arange(count), q, k)
    # layer 0: fresh KV of the buffered tokens lands in the buffer, nothing else
    blender.process_qkv(q, k, v, q, 0, None, attention_metadata(count))
    assert torch.equal(buffer_k[0], rotated_k[start:]) and torch.equal(buffer_v[0], v[start:])
    # layer 1 (check): tokens 0, 1 always chosen; 3 of the 6 cached ones by deviation
    buffer_k[1].copy_(rotated_k[start:])
    buffer_k[1][[1, 4]] += 10.0  # tokens 3 and 6 deviate most, then token 2 a little
    buffer_k[1][0] += 1.0
    _, keys, values, _, _, _ = blender.process_qkv(q, k, v, q, 1, None, attention_metadata(count))
    assert blender.metadata.imp_indices.tolist() == [0, 1, 2, 3, 6]
    assert keys.shape == (count, HIDDEN) and values.shape == (count, HIDDEN)
    assert torch.equal(keys[:start], rotated_k[:start]) and torch.equal(values[:start], v[:start])
    assert torch.equal(keys[start:], buffer_k[1]) and torch.equal(buffer_k[1], rotated_k[start:])
