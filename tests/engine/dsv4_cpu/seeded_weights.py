"""A vLLM model loader that draws every weight from a seed: ``load_format="lmcache_ascend_seeded"``.

DeepSeek-V4 has no transformers class to write a checkpoint with (vLLM reads its
config itself), and vLLM's own dummy weights (every tensor the same uniform
draw in ±1e-3, norms included) give a model whose greedy output follows nothing
of its prompt. This loader is vLLM's dummy loader with other numbers: norm
weights 1, every other floating tensor normal with standard deviation
``1/sqrt(last dimension)`` (a weight's fan-in), each from its own generator
seeded by the model's seed (``lmcache_ascend_weight_seed`` in its config.json,
`tests.engine.models.build`) and the tensor's name, so every engine process of
every run draws the same model. Integer tensors (hash-routing tables) keep what vLLM drew
at construction from its seeded global generator.
"""

from __future__ import annotations

import hashlib

LOAD_FORMAT = "lmcache_ascend_seeded"
SEED_KEY = "lmcache_ascend_weight_seed"


def _generator(seed: int, name: str):
    import torch

    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def fill(seed: int, name: str, tensor) -> None:
    import torch

    if not torch.is_floating_point(tensor) or tensor.device.type == "meta":
        return
    *owner, leaf = name.split(".")
    if leaf == "weight" and owner and "norm" in owner[-1]:
        tensor.fill_(1.0)
        return
    std = tensor.shape[-1] ** -0.5 if tensor.dim() >= 2 else 0.02
    values = torch.randn(tensor.shape, generator=_generator(seed, name), dtype=torch.float32) * std
    tensor.copy_(values.to(tensor.dtype))


def register() -> None:
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    @register_model_loader(LOAD_FORMAT)
    class SeededModelLoader(DummyModelLoader):
        def load_weights(self, model, model_config) -> None:
            import torch

            seed = getattr(model_config.hf_config, SEED_KEY)
            with torch.no_grad():
                for name, tensor in model.state_dict(keep_vars=True).items():
                    fill(seed, name, tensor.data)
