"""Patches whose target module belongs to the `vllm` distribution."""
