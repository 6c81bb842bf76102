"""Building LMCache's real blending objects on a CPU test machine.

LMCache's ``SegmentTokenDatabase`` loads a Hugging Face tokenizer by model
name; no model can be downloaded here, so `write_tiny_tokenizer` writes a tiny
word-level one (a stand-in for model data) whose directory is the model name.
"""

from __future__ import annotations

NUM_LAYERS = 3
HIDDEN = 16  # 2 KV heads x 8 features: kv_shape of `make_lmcache_metadata`
SEP = [2, 2]  # " # # " with the tiny tokenizer


def write_tiny_tokenizer(directory) -> None:
    """Words "0".."9", "#" and "<s>"; every encoding starts with "<s>", as
    LMCache assumes when it drops the first id of the separator."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "<unk>": 1, "#": 2, **{str(i): 3 + i for i in range(10)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", unk_token="<unk>").save_pretrained(
        str(directory)
    )


def make_lmcache_config(**overrides):
    from lmcache.v1.config import LMCacheEngineConfig

    settings = dict(
        chunk_size=16,
        local_cpu=True,
        max_local_cpu_size=0.01,
        use_layerwise=True,
        enable_blending=True,
        blend_special_str=" # # ",
        blend_check_layers=[1],
        blend_recompute_ratios=[0.25],
    )
    settings.update(overrides)
    return LMCacheEngineConfig.from_defaults(**settings)


def make_lmcache_metadata(model_dir, num_layers: int = NUM_LAYERS):
    import torch
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(
        model_name=str(model_dir),
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.float32,
        kv_shape=(num_layers, 2, 16, 2, 8),
    )




def make_lmcache_engine(model_dir):
    """A real LMCacheEngine: CPU storage, layerwise, blending; no device connector."""
    from lmcache.v1.cache_engine import LMCacheEngine
    from lmcache.v1.token_database import SegmentTokenDatabase

    config = make_lmcache_config()
    metadata = make_lmcache_metadata(model_dir)
    engine = LMCacheEngine(
        config, metadata, SegmentTokenDatabase(config, metadata), None, lambda t, r: None, lambda o, r: o
    )
    engine.post_init()
    assert engine.storage_manager is not None and engine.num_layers == NUM_LAYERS
    return engine


def store_document_kv(engine, document: list[int], layers) -> None:
    """Put one document's KV into LMCache as the blending store path would:
    one ``KV_2TD`` object ``[2, tokens, HIDDEN]`` per layer, keyed by the
    document's own tokens."""
    import torch
    from lmcache.v1.memory_management import MemoryFormat

    ((_, _, key),) = list(engine.token_database.process_tokens(tokens=document))
    for layer_key, kv in zip(key.split_layers(NUM_LAYERS), layers, strict=True):
        memory_obj = engine.storage_manager.allocate(
            torch.Size([2, len(document), HIDDEN]), torch.float32, MemoryFormat.KV_2TD
        )
        memory_obj.tensor.copy_(kv)
        engine.storage_manager.batched_put([layer_key], [memory_obj])
