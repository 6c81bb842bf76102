"""Tiny random-weight models for the engine tests, built at test time from a config and a seed.

No hub, no tokenizer: the engine runs with ``skip_tokenizer_init`` on token ids
(`add_word_tokenizer` gives one a tokenizer where a server must take text).
Weights are drawn by transformers' own initialisation (``initializer_range`` 0.02)
from a fixed seed, and saved as a local checkpoint vLLM loads like any other.
`sensitivity` prompts check that a model's greedy output depends on the first
token of a long prompt (the tests assert it), so that equal outputs with and
without KV reuse mean the reused KV was right.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DSV4", "MODELS", "TinyModel", "add_word_tokenizer", "build"]


@dataclass(frozen=True)
class TinyModel:
    name: str
    architecture: str  # transformers class that writes the checkpoint
    config: dict  # the config class's keyword arguments
    seed: int
    # What vLLM's hybrid KV-cache manager makes of it: one entry per KV-cache group.
    expected_groups: tuple[str, ...]
    sliding_window: int | None
    # vLLM attention backend to ask for (None: vLLM's choice), where its choice depends on the CPU.
    attention_backend: str | None = None
    dtype: str = "float32"  # the engine's dtype
    # vLLM load format that draws the weights in the engine (None: a checkpoint transformers writes).
    load_format: str | None = None

    @property
    def cache_key(self) -> str:
        return json.dumps([self.architecture, self.config, self.seed], sort_keys=True)


_GEMMA3 = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # vLLM's CPU attention takes head sizes that are multiples of 32
    query_pre_attn_scalar=32,
    max_position_embeddings=4096,
    initializer_range=0.02,
)

MODELS: dict[str, TinyModel] = {
    model.name: model
    for model in (
        # Gemma-3 style: sliding and full attention layers alternate; 2 KV-cache groups.
        TinyModel(
            name="gemma3-sliding128",
            architecture="Gemma3ForCausalLM",
            config=dict(
                _GEMMA3,
                num_hidden_layers=4,
                sliding_window=128,
                layer_types=["sliding_attention", "full_attention"] * 2,
            ),
            seed=1,
            expected_groups=("SlidingWindowSpec", "FullAttentionSpec"),
            sliding_window=128,
        ),
        # Another group structure: a 64-token window, 3 sliding layers per full one.
        # The hybrid manager groups layers in equal-sized groups: 3 sliding groups of
        # 2 layers and 1 full-attention group.
        TinyModel(
            name="gemma3-sliding64-3to1",
            architecture="Gemma3ForCausalLM",
            config=dict(
                _GEMMA3,
                num_hidden_layers=8,
                sliding_window=64,
                layer_types=["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"],
            ),
            seed=1,
            expected_groups=("SlidingWindowSpec",) * 3 + ("FullAttentionSpec",),
            sliding_window=64,
        ),
        # The control: full attention only, one KV-cache group.
        TinyModel(
            name="llama-full",
            architecture="LlamaForCausalLM",
            config=dict(
                vocab_size=512,
                hidden_size=128,
                intermediate_size=256,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=32,
                max_position_embeddings=4096,
                initializer_range=0.02,
            ),
            seed=1,
            expected_groups=("FullAttentionSpec",),
            sliding_window=None,
        ),
    )
}


# Further model kinds (tests/engine/test_engine_kinds.py): MLA and state-space models.
# The attention side the state-space hybrids share.
_HYBRID = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    initializer_range=0.02,
)
KIND_MODELS: dict[str, TinyModel] = {
    model.name: model
    for model in (
        # DeepSeek-V2 style MLA, dense MLPs. vLLM's CPU MLA kernel takes only a 576-wide
        # latent row (kv_lora_rank 512 + rope 64).
        TinyModel(
            name="deepseek-v2-mla",
            architecture="DeepseekV2ForCausalLM",
            config=dict(
                vocab_size=512,
                hidden_size=128,
                intermediate_size=256,
                moe_intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=2,
                n_routed_experts=4,
                n_shared_experts=1,
                num_experts_per_tok=2,
                first_k_dense_replace=2,
                kv_lora_rank=512,
                q_lora_rank=None,
                qk_rope_head_dim=64,
                qk_nope_head_dim=32,
                v_head_dim=32,
                max_position_embeddings=4096,
                initializer_range=0.02,
            ),
            seed=1,
            expected_groups=("MLAAttentionSpec",),
            sliding_window=None,
            # On a CPU with AMX tiles vLLM picks AMX_MLA, which takes only bfloat16 weights and
            # keeps prefix caching on; the reference CPU_MLA runs on every x86 CPU, as CI's may.
            attention_backend="CPU_MLA",
        ),
        # Mamba2 layers beside attention layers: a MambaSpec group and a full-attention group.
        TinyModel(
            name="granite-hybrid",
            architecture="GraniteMoeHybridForCausalLM",
            config=dict(
                _HYBRID,
                shared_intermediate_size=256,
                num_local_experts=0,
                num_experts_per_tok=0,
                num_hidden_layers=4,
                layer_types=["mamba", "attention", "mamba", "attention"],
                mamba_n_heads=8,
                mamba_d_head=32,
                mamba_d_state=16,
                mamba_n_groups=1,
                mamba_expand=2,
                mamba_d_conv=4,
                mamba_chunk_size=256,
                position_embedding_type="rope",
            ),
            seed=1,
            expected_groups=("MambaSpec", "FullAttentionSpec"),
            sliding_window=None,
        ),
        # A pure state-space model: Mamba2 layers only.
        TinyModel(
            name="mamba2",
            architecture="Mamba2ForCausalLM",
            config=dict(
                vocab_size=512,
                hidden_size=128,
                num_hidden_layers=2,
                state_size=16,
                expand=2,
                head_dim=32,
                num_heads=8,
                n_groups=1,
                conv_kernel=4,
                chunk_size=256,
                initializer_range=0.02,
            ),
            seed=1,
            expected_groups=("MambaSpec",),
            sliding_window=None,
        ),
        # NemotronH: Mamba2, attention and MLP layers in a pattern.
        TinyModel(
            name="nemotron-h",
            architecture="NemotronHForCausalLM",
            config=dict(
                _HYBRID,
                layers_block_type=["mamba", "attention", "mlp", "mamba", "attention", "mlp"],
                head_dim=32,
                mamba_num_heads=8,
                mamba_head_dim=32,
                ssm_state_size=16,
                n_groups=1,
                conv_kernel=4,
                expand=2,
                chunk_size=256,
            ),
            seed=1,
            expected_groups=("MambaSpec", "FullAttentionSpec"),
            sliding_window=None,
        ),
        # Falcon-H1: attention and Mamba2 side by side in every layer.
        TinyModel(
            name="falcon-h1",
            architecture="FalconH1ForCausalLM",
            config=dict(
                _HYBRID,
                num_hidden_layers=2,
                mamba_d_ssm=256,
                mamba_n_heads=8,
                mamba_d_head=32,
                mamba_n_groups=1,
                mamba_d_state=16,
                mamba_d_conv=4,
                mamba_expand=2,
                mamba_chunk_size=256,
            ),
            seed=1,
            expected_groups=("FullAttentionSpec", "MambaSpec"),
            sliding_window=None,
        ),
        # Qwen3-Next: gated delta-net (linear attention) layers beside full attention, MoE MLPs.
        # vLLM's CPU gated delta-net runs in bfloat16.
        TinyModel(
            name="qwen3-next",
            architecture="Qwen3NextForCausalLM",
            config=dict(
                _HYBRID,
                num_hidden_layers=4,
                head_dim=32,
                linear_conv_kernel_dim=4,
                linear_key_head_dim=128,  # vLLM's CPU gated delta-net takes 128-wide heads
                linear_value_head_dim=128,
                linear_num_key_heads=1,
                linear_num_value_heads=2,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=64,
                shared_expert_intermediate_size=64,
                decoder_sparse_step=1,
                layer_types=["linear_attention", "full_attention"] * 2,
            ),
            seed=1,
            expected_groups=("MambaSpec", "FullAttentionSpec"),
            sliding_window=None,
            dtype="bfloat16",
        ),
    )
}


# DeepSeek-V4 (vLLM's CPU build), bfloat16: every KV-cache kind of the model. Layer 0 attends to
# its sliding window alone; layers 1 and 3 add ratio-4 compressed attention with its indexer (an
# indexer K cache and compressor state for each); layer 2 ratio-128 compressed attention (and its
# compressor state). vLLM's CPU kernels fix some sizes: routing takes 64, 128, 256 or 384 experts
# and 6 of them per token, the indexer's top-k is 512, the attention head 512 wide (64 of it rope).
# No transformers class writes this model: the engine draws its weights
# (tests/engine/dsv4_cpu/seeded_weights.py).
DSV4 = TinyModel(
    name="deepseek-v4",
    architecture="DeepseekV4ForCausalLM",
    config=dict(
        model_type="deepseek_v4",
        torch_dtype="bfloat16",
        bos_token_id=0,
        eos_token_id=1,
        vocab_size=512,
        hidden_size=256,
        num_hidden_layers=4,
        compress_ratios=[0, 4, 128, 4],
        sliding_window=128,
        num_attention_heads=16,
        num_key_value_heads=1,
        head_dim=512,
        qk_rope_head_dim=64,
        q_lora_rank=128,
        o_lora_rank=128,
        o_groups=4,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=512,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        n_routed_experts=64,
        n_shared_experts=1,
        num_experts_per_tok=6,
        moe_intermediate_size=64,
        num_hash_layers=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.5,
        scoring_func="sqrtsoftplus",
        topk_method="noaux_tc",
        expert_dtype="bf16",
        hidden_act="silu",
        swiglu_limit=10.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        rope_theta=10000,
        compress_rope_theta=160000,
        num_nextn_predict_layers=0,
    ),
    seed=1,
    expected_groups=("UniformTypeKVCacheSpecs",) * 5,
    sliding_window=128,
    dtype="bfloat16",
    load_format="lmcache_ascend_seeded",
)


def build(model: TinyModel, directory: Path) -> Path:
    """Write `model`'s checkpoint under `directory` (reused when already written); for a model whose
    weights the engine draws (``load_format``), its config alone."""
    target = Path(directory) / model.name
    stamp = target / "lmcache_ascend_model.json"
    if stamp.exists() and stamp.read_text() == model.cache_key:
        return target
    if model.load_format:
        target.mkdir(parents=True, exist_ok=True)
        config = {"architectures": [model.architecture], **model.config, "lmcache_ascend_weight_seed": model.seed}
        (target / "config.json").write_text(json.dumps(config, indent=1))
        stamp.write_text(model.cache_key)
        return target
    import torch
    import transformers

    architecture = getattr(transformers, model.architecture)
    config = architecture.config_class(**model.config)
    torch.manual_seed(model.seed)
    network = architecture(config).to(torch.float32)
    network.save_pretrained(target)
    stamp.write_text(model.cache_key)
    return target


def add_word_tokenizer(model_dir: Path) -> Path:
    """Give a built checkpoint a tokenizer, so a server can take text: one word per token id,
    ``w0`` .. ``w<vocab-1>`` split at white space (``w0`` unknown, ``w1`` end, ``w2`` start)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    words = Tokenizer(models.WordLevel(vocab={f"w{index}": index for index in range(vocab_size)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", eos_token="w1", bos_token="w2").save_pretrained(model_dir)
    return Path(model_dir)
