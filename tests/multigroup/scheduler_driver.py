"""Drive the scheduler side of LMCache's real in-process connector.

`make_connector_impl` builds a real ``LMCacheConnectorV1Impl`` (LMCache's
adapter class, patched or not) for the scheduler role without starting
LMCache's services: the constructor would start a lookup client, a ZMQ
server and an engine, none of which the scheduler-side bookkeeping under
test uses. So the object is created with ``object.__new__`` and given the
scheduler-side state upstream's ``_init_connector_state`` sets (same names,
same values for a default config), with a real ``LMCacheEngineConfig`` and
a real parent connector object holding the real ``KVCacheConfig``. The only
stand-in is the lookup client (a network client): `NoLookupClient`.

`RequestDriver` plays vLLM's scheduler for one request: it builds real
``NewRequestData`` / ``CachedRequestData`` / ``SchedulerOutput`` objects and a
real ``vllm.v1.request.Request``, with block ids chosen by the test.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

from vllm import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.request import Request

from tests.fixtures.kv_cache_configs import KVCacheFixture


class NoLookupClient:
    """Stands in for LMCache's ZMQ lookup client; the scheduler bookkeeping only clears status."""

    def __init__(self) -> None:
        self.cleared: list[str] = []

    def clear_lookup_status(self, lookup_id: str) -> None:
        self.cleared.append(lookup_id)


def make_connector_impl(
    fixture: KVCacheFixture,
    chunk_size: int = 256,
    discard_partial_chunks: bool = True,
    connector_class: type | None = None,
):
    from lmcache.integration.vllm.lmcache_connector_v1 import LMCacheConnectorV1Dynamic
    from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl
    from lmcache.v1.config import LMCacheEngineConfig

    parent = object.__new__(connector_class or LMCacheConnectorV1Dynamic)
    parent._kv_cache_config = fixture.kv_cache_config
    impl = object.__new__(LMCacheConnectorV1Impl)
    parent._lmcache_engine = impl
    impl._parent = parent
    impl.config = LMCacheEngineConfig.from_defaults(chunk_size=chunk_size)
    impl._manager = types.SimpleNamespace(lookup_client=NoLookupClient(), lmcache_engine=None)
    impl.kv_role = "kv_both"
    impl.force_skip_save = False
    impl.async_loading = False
    impl._unfinished_requests = {}
    impl.load_specs = {}
    impl._request_trackers = {}
    impl._requests_priority = {}
    impl.kv_caches = {}
    impl._block_size = fixture.vllm_block_size
    impl._lmcache_chunk_size = chunk_size
    impl._discard_partial_chunks = discard_partial_chunks
    impl.skip_last_n_tokens = 0
    impl._max_tokens_per_load = 0
    impl._invalid_block_ids = set()
    return impl


def _scheduler_output(new_reqs, cached: CachedRequestData, num_scheduled: dict[str, int], finished=()) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=list(new_reqs),
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=dict(num_scheduled),
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        num_common_prefix_blocks=[0],
        finished_req_ids=set(finished),
        free_encoder_mm_hashes=[],
    )


@dataclass
class RequestDriver:
    """One request's life through the connector's scheduler side."""

    impl: object
    req_id: str
    prompt: list[int]
    request: Request = field(init=False)

    def __post_init__(self) -> None:
        self.request = Request(
            request_id=self.req_id,
            prompt_token_ids=list(self.prompt),
            sampling_params=SamplingParams(max_tokens=64),
            pooling_params=None,
        )

    def start(self, num_tokens: int, block_ids: tuple[list[int], ...], vllm_cached_tokens: int = 0):
        """First schedule: `num_tokens` new tokens after `vllm_cached_tokens` prefix hits."""
        self.request.num_computed_tokens = vllm_cached_tokens
        self.impl.update_state_after_alloc(self.request, 0)
        new = NewRequestData(
            req_id=self.req_id,
            prompt_token_ids=list(self.prompt),
            mm_features=[],
            sampling_params=self.request.sampling_params,
            pooling_params=None,
            block_ids=tuple(list(ids) for ids in block_ids),
            num_computed_tokens=vllm_cached_tokens,
            lora_request=None,
        )
        return self._step([new], CachedRequestData.make_empty(), num_tokens)

    def advance(self, num_tokens: int, new_block_ids: tuple[list[int], ...] | None, output_token: int | None = None):
        """A running request scheduled again for `num_tokens` tokens."""
        if output_token is not None:
            self.request.append_output_token_ids(output_token)
        cached = self._cached(new_block_ids, resumed=False, num_tokens=num_tokens)
        return self._step([], cached, num_tokens)

    def resume_after_preemption(
        self, num_tokens: int, block_ids: tuple[list[int], ...], lmcache_cached_tokens: int, vllm_cached_tokens: int
    ):
        """vLLM preempted the request and now resumes it with a fresh block table and a load."""
        from lmcache.integration.vllm.vllm_v1_adapter import LoadSpec

        self.impl.load_specs[self.req_id] = LoadSpec(
            vllm_cached_tokens=vllm_cached_tokens, lmcache_cached_tokens=lmcache_cached_tokens, can_load=False
        )
        self.impl.update_state_after_alloc(self.request, lmcache_cached_tokens - vllm_cached_tokens)
        self.request.num_computed_tokens = max(lmcache_cached_tokens, vllm_cached_tokens)
        cached = self._cached(block_ids, resumed=True, num_tokens=num_tokens)
        return self._step([], cached, num_tokens)

    def running(self, num_tokens: int, new_block_ids: tuple[list[int], ...] | None, output_token: int | None = None):
        """`advance`'s part of a step that `step_together` runs with other requests' parts."""
        if output_token is not None:
            self.request.append_output_token_ids(output_token)
        return self, self._cached(new_block_ids, resumed=False, num_tokens=num_tokens), num_tokens

    def resuming(
        self, num_tokens: int, block_ids: tuple[list[int], ...], lmcache_cached_tokens: int, vllm_cached_tokens: int
    ):
        """`resume_after_preemption`'s part of a step that `step_together` runs with other requests' parts."""
        from lmcache.integration.vllm.vllm_v1_adapter import LoadSpec

        self.impl.load_specs[self.req_id] = LoadSpec(
            vllm_cached_tokens=vllm_cached_tokens, lmcache_cached_tokens=lmcache_cached_tokens, can_load=False
        )
        self.impl.update_state_after_alloc(self.request, lmcache_cached_tokens - vllm_cached_tokens)
        self.request.num_computed_tokens = max(lmcache_cached_tokens, vllm_cached_tokens)
        return self, self._cached(block_ids, resumed=True, num_tokens=num_tokens), num_tokens

    def finish(self):
        return self.impl.build_connector_meta(_scheduler_output([], CachedRequestData.make_empty(), {}, finished=[self.req_id]))

    def _cached(self, new_block_ids, resumed: bool, num_tokens: int) -> CachedRequestData:
        start = self.request.num_computed_tokens
        return CachedRequestData(
            req_ids=[self.req_id],
            resumed_req_ids={self.req_id} if resumed else set(),
            new_token_ids=[self.request.all_token_ids[start : start + num_tokens]],
            all_token_ids={self.req_id: list(self.request.all_token_ids)} if resumed else {},
            new_block_ids=[None if new_block_ids is None else tuple(list(ids) for ids in new_block_ids)],
            num_computed_tokens=[start],
            num_output_tokens=[self.request.num_output_tokens],
        )

    def _step(self, new_reqs, cached, num_tokens: int):
        meta = self.impl.build_connector_meta(_scheduler_output(new_reqs, cached, {self.req_id: num_tokens}))
        # vLLM advances num_computed_tokens after building the connector metadata.
        self.request.num_computed_tokens += num_tokens
        return meta


def step_together(impl, parts):
    """One scheduler step of several running requests, in the order given: `parts` come from
    `RequestDriver.running` / `RequestDriver.resuming` (one per request)."""
    cached = [part[1] for part in parts]
    merged = CachedRequestData(
        req_ids=[req_id for c in cached for req_id in c.req_ids],
        resumed_req_ids={req_id for c in cached for req_id in c.resumed_req_ids},
        new_token_ids=[ids for c in cached for ids in c.new_token_ids],
        all_token_ids={req_id: ids for c in cached for req_id, ids in c.all_token_ids.items()},
        new_block_ids=[ids for c in cached for ids in c.new_block_ids],
        num_computed_tokens=[n for c in cached for n in c.num_computed_tokens],
        num_output_tokens=[n for c in cached for n in c.num_output_tokens],
    )
    meta = impl.build_connector_meta(
        _scheduler_output([], merged, {driver.req_id: num_tokens for driver, _, num_tokens in parts})
    )
    for driver, _, num_tokens in parts:
        driver.request.num_computed_tokens += num_tokens
    return meta
