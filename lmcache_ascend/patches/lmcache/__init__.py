"""Patches whose target module belongs to the `lmcache` distribution."""
