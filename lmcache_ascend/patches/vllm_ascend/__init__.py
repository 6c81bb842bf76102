"""Patches whose target module belongs to the `vllm_ascend` distribution."""
