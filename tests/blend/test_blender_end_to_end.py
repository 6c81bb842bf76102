"""Hole-mode CacheBlend through LMCache's real blender and engine, end to end.

``LMCBlender.blend`` (real, patched) drives ``LMCacheEngine.retrieve_layer``
(real, patched, real CPU storage) and a layerwise model; the KV it leaves in
"paged memory" must equal what the reference hole-mode blend computes.

Stand-ins, each for something that needs a GPU/NPU or model weights:
* the layerwise model: LMCache builds it from a vLLM model; this one runs the
  same per-layer loop (project, ``blender.process_qkv``, attend, MLP) with the
  tiny reference transformer's weights;
* the layerwise device connector: the CPU analogue of LMCache's
  ``VLLMBufferLayerwiseGPUConnector`` (same generator protocol, a buffer per
  layer over ``[starts[0], ends[-1])`` with gaps zeroed, flushed to paged
  memory two steps later);
* re-rotation of stored K: LMCache's connector does it from cached positions;
  here the stored K is re-rotated up front with `rerotate_keys`.
"""

from __future__ import annotations

import types

import pytest
import torch

from lmcache_ascend.patches import State, registry
from tests.blend.lmcache_setup import HIDDEN, NUM_LAYERS, SEP, store_document_kv
from tests.blend.reference.documents import lookup_segments
from tests.blend.reference.model import PromptKV, TinyModelConfig, TinyRopeTransformer
from tests.blend.reference.rope import apply_rope, rerotate_keys
from tests.patching import apply_now

REGISTRY = registry.process_registry()
ENGINE_PATCH = "lmcache-blend-holes-engine"
BLENDER_PATCH = "lmcache-blend-holes-blender"
RATIO = 0.3
# Token ids 3..12 are the tiny tokenizer's words; distinct from test_patches' documents.
SYSTEM, DOC_1, DOC_2, MISSING = [12, 11, 10, 9], [3, 4, 3, 4, 3, 4], [5, 6, 7, 8, 5, 6, 7], [9, 9, 9, 9]


@pytest.fixture
def hole_patches(monkeypatch):
    monkeypatch.setenv("LMCACHE_ASCEND_BLEND_HOLES", "1")
    for name in (ENGINE_PATCH, BLENDER_PATCH):
        assert apply_now(REGISTRY, name) is State.APPLIED
    yield
    for name in (BLENDER_PATCH, ENGINE_PATCH):
        REGISTRY.revert(name)


class CpuBufferConnector:
    """CPU analogue of LMCache's layerwise buffer connector (see module doc)."""

    def __init__(self, num_tokens: int) -> None:
        self.paged = [torch.full((2, num_tokens, HIDDEN), float("nan")) for _ in range(NUM_LAYERS)]
        self.buffers: dict[int, torch.Tensor] = {}

    def get_kv(self, layer_id: int):
        return self.buffers[layer_id][0], self.buffers[layer_id][1]

    def batched_to_gpu(self, starts, ends, **kwargs):
        slot_mapping = kwargs["slot_mapping"]
        first, width = starts[0], ends[-1] - starts[0]
        loaded = None
        for layer_id in range(NUM_LAYERS + 2):
            if layer_id > 1:
                self.paged[layer_id - 2][:, slot_mapping[first : first + width]] = self.buffers.pop(layer_id - 2)
            if 0 < layer_id <= NUM_LAYERS:
                self.buffers[layer_id - 1] = loaded
            if layer_id < NUM_LAYERS:
                memory_objs = yield
                loaded = torch.zeros(2, width, HIDDEN)  # gaps stay zero, as upstream zeroes them
                for start, end, obj in zip(starts, ends, memory_objs):
                    loaded[:, start - first : end - first] = obj.tensor
            elif layer_id == NUM_LAYERS:
                yield
        yield


class TinyLayerwiseModel:
    """LMCache's layerwise model loop over the tiny reference transformer."""

    def __init__(self, model: TinyRopeTransformer, blender) -> None:
        self.model, self.blender = model, blender
        heads, head_dim = model.config.num_heads, model.config.head_dim

        def rotary_emb(positions, q, k):
            rotate = lambda x: apply_rope(x.view(x.shape[0], heads, head_dim), positions, model.rope)  # noqa: E731
            return rotate(q).reshape(q.shape), rotate(k).reshape(k.shape)

        layer = types.SimpleNamespace(self_attn=types.SimpleNamespace(rotary_emb=rotary_emb))
        self.vllm_model = types.SimpleNamespace(model=types.SimpleNamespace(layers=[layer] * NUM_LAYERS))

    def compute_layer(self, tokens):
        from lmcache.v1.compute.attention.metadata import LMCFlashAttnMetadata

        model, heads, head_dim = self.model, self.model.config.num_heads, self.model.config.head_dim
        count = tokens.shape[0]
        hidden = model.embedding[tokens]
        attn_output = None
        attn_metadata = LMCFlashAttnMetadata(
            query_start_loc=torch.tensor([0, count]),
            seq_lens=torch.tensor([count]),
            cu_seqlens_k=torch.tensor([0, count]),
            max_query_len=count,
            max_seq_len=count,
        )
        for layer_id in range(NUM_LAYERS):
            q, k, v = model.project_qkv(layer_id, hidden, None)
            q, k, v, residual, attn_output, attn_metadata = self.blender.process_qkv(
                q.flatten(1), k.flatten(1), v.flatten(1), hidden, layer_id, attn_output, attn_metadata
            )
            chosen = self.blender.metadata.imp_indices
            query_index = torch.arange(count) if chosen is None else chosen
            split = lambda x: x.reshape(x.shape[0], heads, head_dim)  # noqa: E731
            attention = model.attend(split(q), split(k), split(v), query_index)
            hidden = model.finish_layer(layer_id, residual, attention)
            yield


def build_blender(engine, connector, model):
    from lmcache.v1.compute.blend.blender import LMCBlender
    from lmcache.v1.compute.blend.metadata import LMCBlendCommonMetadata, LMCBlendMetadata

    blender = LMCBlender.__new__(LMCBlender)  # its __init__ needs a vLLM model
    blender.cache_engine = engine
    blender.gpu_connector = connector
    blender.num_layers = NUM_LAYERS
    blender.common_metadata = LMCBlendCommonMetadata(check_layers=[1], recomp_ratios=[RATIO])
    blender.metadata = LMCBlendMetadata()
    blender.layerwise_model = TinyLayerwiseModel(model, blender)
    return blender


def test_lmcache_blender_in_hole_mode_leaves_the_reference_kv(engine, hole_patches):
    model = TinyRopeTransformer(
        TinyModelConfig(vocab_size=16, hidden_size=HIDDEN, num_heads=2, num_layers=NUM_LAYERS, mlp_size=32, seed=7)
    )
    documents = [SYSTEM, DOC_1, MISSING, DOC_2]
    tokens: list[int] = []
    for index, document in enumerate(documents):
        tokens += (SEP if index else []) + document
    lookup = lookup_segments(tokens, SEP, lambda seg_tokens, _: list(seg_tokens) != MISSING)
    count = len(tokens)

    # Cache every document but MISSING, computed after the system prompt alone
    # (the system prompt itself in place), re-rotated to its place in `tokens`.
    shape = (count, model.config.num_heads, model.config.head_dim)
    cached = PromptKV(
        tuple(torch.full(shape, float("nan")) for _ in range(NUM_LAYERS)),
        tuple(torch.full(shape, float("nan")) for _ in range(NUM_LAYERS)),
    )
    for segment in lookup.hit_segments:
        document = tokens[segment.start : segment.end]
        context = document if document == SYSTEM else SYSTEM + SEP + document
        stored_start = len(context) - len(document)
        _, kv = model.prefill(torch.tensor(context))
        layers = []
        for layer in range(NUM_LAYERS):
            keys = rerotate_keys(
                kv.keys[layer][stored_start:],
                torch.arange(stored_start, len(context)),
                torch.arange(segment.start, segment.end),
                model.rope,
            )
            cached.keys[layer][segment.start : segment.end] = keys
            cached.values[layer][segment.start : segment.end] = kv.values[layer][stored_start:]
            layers.append(torch.stack((keys.flatten(1), kv.values[layer][stored_start:].flatten(1))))
        store_document_kv(engine, document, layers)

    assert engine.lookup(tokens=tokens) == count  # past the hole, to the end of DOC_2
    connector = CpuBufferConnector(count)
    engine.gpu_connector = connector
    blender = build_blender(engine, connector, model)
    blender.blend(torch.tensor(tokens), None, slot_mapping=torch.arange(count))

    mask = torch.tensor(lookup.cached_token_mask())
    reference = model.blend_prefill(torch.tensor(tokens), cached, mask, 1, RATIO, lookup.cached_stretches())
    for layer in range(NUM_LAYERS):
        paged_k, paged_v = connector.paged[layer]
        assert torch.isfinite(paged_k).all() and torch.isfinite(paged_v).all()  # every row written
        assert torch.allclose(paged_k, reference.kv.keys[layer].flatten(1), atol=1e-5)
        assert torch.allclose(paged_v, reference.kv.values[layer].flatten(1), atol=1e-5)
    # the hole (4 tokens + separators) and the top-k were recomputed; the rest reused
    hole_tokens = count - lookup.num_cached_tokens
    assert reference.recomputed.numel() < count and reference.selection.num_hole_tokens == hole_tokens
    assert connector.buffers == {} and blender.metadata.imp_indices is None  # all flushed, state cleaned
    # and blending really mattered: plain reuse of the cached rows differs from the result
    assert not torch.allclose(connector.paged[2][0], cached.keys[2].flatten(1).nan_to_num(), atol=1e-3)
