"""Multi-group (hybrid) KV-cache planning for LMCache's in-process connector.

Pure logic, importing neither vLLM nor LMCache:

- what a KV-cache group is: the spec types and what each needs (`spec_kinds`), group
  specs (`specs`), the state-group skip policy (`state_skip`);
- the connector's decisions at start (`connector_state`), its scheduler side
  (`adapter_scheduler`), whether reuse can be exact (`reuse_verdict`), the
  ``SupportsHMA`` hooks (`hma`);
- per-request block tracking (`tracker`), per-group slicing and prefix bounds
  (`slicing`), per-group slot mappings handed to the worker (`slots`);
- failed loads (`load_failures`), the MP server's groups and wire format
  (`mp_server`, `mp_wire`), and facts attached to upstream objects (`attachments`).
"""
