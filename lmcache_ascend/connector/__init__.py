"""Device connectors lmcache-ascend swaps into LMCache (these modules import LMCache)."""
