"""Multi-group (hybrid) KV-cache planning for LMCache's in-process connector.

Pure logic, importing neither vLLM nor LMCache: group specs (`specs`), the
state-group skip policy (`state_skip`), per-request block tracking
(`tracker`), per-group slicing and prefix bounds (`slicing`) and per-group
slot mappings handed to the worker (`slots`).
"""
