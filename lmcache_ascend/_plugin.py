"""vLLM `vllm.general_plugins` entry point: every vLLM process (API server, engine
core, workers) calls `register`, also when started with an environment in which
the .pth hook was turned off."""


def register() -> None:
    import lmcache_ascend

    lmcache_ascend.activate(source="vllm-plugin")
