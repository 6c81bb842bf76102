"""A whole request through the batched data path vs the old per-chunk path (used by bench_transfer.py --request).

One request of `tokens` tokens in LMCache chunks of `chunk_size`, stored and
loaded, for (a) a DeepSeek-V4-like layout of four scheduler groups bundled into
four layer groups (C4 attention fp8, C4 indexer int8 K + fp16 scale, C128
attention, a 128-token sliding window in bf16) and (b) plain MLA (bf16 576, one
group). Cases, interleaved round by round on the same buffers:

* ``copy_d2d``: a torch device-to-device copy of the request's payload bytes;
* ``hand_over``: the request's slots resolved on the device from its block ids
  (`DeviceSlots.from_block_ids`), as the connector does for a store when
  ``wait_for_save`` hands the request over, before the store call;
* ``ours_device``: the batched path (`move_chunks`, device memory objects), one
  synchronization; a store over the handed-over slots, a load resolving them
  inside the call (after its first staged copies are queued), as the connector;
* ``old_device``: the old path: per chunk every group's slot tensor rebuilt on the
  host (window mask, ``torch.where``), copied to the device, one chunk moved, a
  synchronization;
* ``copy_pinned``: one pinned host <-> device copy of the payload bytes;
* ``copy_pinned_chunks``: one pinned host <-> device copy per chunk (what staging
  chunk by chunk would copy at best);
* ``ours_staged``: the batched path with pinned host memory objects, through
  device staging waves with copies on a copy stream;
* ``old_host``: the old path with host objects (one device chunk buffer, copy per chunk).

Before timing, every path's bytes are checked against the old path: stored
chunks equal byte for byte (poisoned first), loaded caches equal byte for byte.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from lmcache_ascend.kernels import launch_counter
from lmcache_ascend.kv_worker import ChunkMover, plan_kv_caches
from lmcache_ascend.kv_worker.device_slots import DeviceSlots
from lmcache_ascend.multigroup.slots import step_block_ids
from lmcache_ascend.multigroup.specs import KVGroupSpec, KVGroups
from lmcache_ascend.multigroup.tracker import GroupBlockTracker
from tests.multigroup.cpu_slots import build_group_slot_mappings

# (name, groups: (class name, block size, compress ratio, window, planes: ((dtype, row elements), ...)), layers)
LAYOUTS = {
    "dsv4_bundled": (
        (
            ("C4AttnKV", 256, 4, None, ((torch.float8_e4m3fn, 576),)),
            ("C4IndexerKV", 256, 4, None, ((torch.int8, 128), (torch.float16, 1))),
            ("C128AttnKV", 256, 128, None, ((torch.float8_e4m3fn, 576),)),
            ("SlidingWindow", 64, 1, 128, ((torch.bfloat16, 576),)),
        ),
        30,
    ),
    "mla": ((("MLAAttention", 64, 1, None, ((torch.bfloat16, 576),)),), 61),
}


# Kernel time / copy kernel time of the flat per-vector kernel (every vector looked up its row's
# slot; it cast the byte anchor to wider element pointers, which triton-ascend cannot lower) on one
# H100 (torch 2.11, Triton 3.6) for this request: what the row-at-a-time kernel is compared with.
FLAT_KERNEL_VS_COPY = {"dsv4_bundled": {"store": 0.952, "load": 0.949}, "mla": {"store": 0.965, "load": 0.957}}


def _synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class RequestCase:
    """KV caches, planned layout, one request's slots and its memory objects (device and pinned host)."""

    def __init__(self, name: str, tokens: int, chunk_size: int, device: torch.device, seed: int = 0):
        groups_spec, layers = LAYOUTS[name]
        generator = torch.Generator().manual_seed(seed)
        self.name, self.tokens, self.chunk_size, self.device = name, tokens, chunk_size, device
        groups = tuple(
            KVGroupSpec(index, cls, block, ratio, window) for index, (cls, block, ratio, window, _) in enumerate(groups_spec)
        )
        self.kv_groups = KVGroups(groups, vllm_block_size=min(g.block_size for g in groups))
        block_ids, kv_caches, plane_groups = [], {}, {}
        for index, (group, (_, _, _, _, planes)) in enumerate(zip(groups, groups_spec)):
            needed = -(-group.num_rows(tokens) // group.rows_per_block)
            num_blocks = 2 * needed + 1
            ids = (torch.randperm(num_blocks - 1, generator=generator)[:needed] + 1).tolist()
            block_ids.append(ids)
            for layer in range(layers):
                tensors = []
                for dtype, row_elements in planes:
                    width = torch.empty((), dtype=dtype).element_size()
                    raw = torch.randint(0, 256, (num_blocks, group.rows_per_block, row_elements * width),
                                        dtype=torch.uint8, generator=generator)
                    tensors.append(raw.to(device).view(dtype))
                kv_caches[f"layer{layer}.group{index}"] = tuple(tensors)
                plane_groups[f"layer{layer}.group{index}"] = (index,)
        self.kv_caches = kv_caches
        _, self.planner = plan_kv_caches(kv_caches, plane_groups, self.kv_groups.groups_by_index(), chunk_size)
        tracker = GroupBlockTracker.for_new_request(tuple(block_ids), len(groups))
        self.group_slots = build_group_slot_mappings(self.kv_groups, tracker, tokens, chunk_size)
        self.step = step_block_ids(self.kv_groups, tracker, tokens, chunk_size)
        self.mover = ChunkMover(self.planner)
        self.handed_over = self.hand_over()
        self.starts = list(range(0, tokens, chunk_size))
        total = self.planner.full_plan.total_bytes
        self.chunk_bytes = total
        self.device_pool = torch.empty(len(self.starts) * total, dtype=torch.uint8, device=device)
        self.host_pool = torch.empty(len(self.starts) * total, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        self.device_chunks = [self.device_pool[i * total : (i + 1) * total] for i in range(len(self.starts))]
        self.host_chunks = [self.host_pool[i * total : (i + 1) * total] for i in range(len(self.starts))]
        self.old_buffer = torch.empty(total, dtype=torch.uint8, device=device)
        # Payload: the KV bytes the chunks really carry (rows moved x row bytes, every layer group).
        slots = self.mover.upload(self.group_slots.transferred_slot_mappings())
        starts = np.asarray(self.starts, dtype=np.int64)
        payload = 0
        for group, (_, counts) in zip(self.planner.layer_groups, self.mover.plane_rows(slots, starts, starts + chunk_size)):
            row_bytes = np.asarray([plane.row_bytes for plane in group.planes], dtype=np.int64)
            payload += int((counts * row_bytes[None, :]).sum()) * group.num_layers
        self.payload = payload
        self.copy_src = torch.randint(0, 256, (payload,), dtype=torch.uint8, device=device)
        self.copy_dst = torch.empty_like(self.copy_src)
        self.copy_host = torch.empty(payload, dtype=torch.uint8, pin_memory=torch.cuda.is_available())

    # ---- the paths -------------------------------------------------------------------
    def hand_over(self) -> DeviceSlots:
        """The request's slots on the device from its block ids, as the connector resolves them."""
        return DeviceSlots.from_block_ids(self.step, self.planner, self.device)

    def timed_hand_over(self) -> int:
        self.hand_over()
        _synchronize()
        return 0

    def ours(self, chunks, store: bool) -> int:
        # As the connector: a store's slots were resolved at hand-over (the `hand_over` case times that),
        # a load resolves them inside the call, when first needed.
        slots = self.handed_over if store else self.hand_over
        launches = self.mover.move_chunks(chunks, self.starts, slots, store=store)
        _synchronize()
        return launches

    def old(self, chunks, store: bool) -> int:
        """The connector before this change: per chunk, slots rebuilt and copied, one chunk moved, a sync."""
        launches = 0
        total = self.chunk_bytes
        for chunk, start in zip(chunks, self.starts):
            pick = self.group_slots.store_slot_mapping if store else self.group_slots.load_slot_mapping
            mappings = {g: pick(g).to(device=self.device, dtype=torch.int64).contiguous()
                        for g in self.group_slots.transferred_groups}
            slots = DeviceSlots.upload(mappings, self.kv_groups.groups_by_index(), self.device)
            if chunk.device == self.device:
                launches += self.mover.move(chunk, start, start + self.chunk_size, slots, store=store)
            elif store:
                launches += self.mover.move(self.old_buffer, start, start + self.chunk_size, slots, store=True)
                chunk[:total].copy_(self.old_buffer, non_blocking=True)
            else:
                self.old_buffer.copy_(chunk[:total], non_blocking=True)
                launches += self.mover.move(self.old_buffer, start, start + self.chunk_size, slots, store=False)
            _synchronize()
        return launches

    def copy_d2d(self, store: bool) -> int:
        self.copy_dst.copy_(self.copy_src)
        _synchronize()
        return 0

    def copy_pinned(self, store: bool) -> int:
        if store:
            self.copy_host.copy_(self.copy_src, non_blocking=True)
        else:
            self.copy_src.copy_(self.copy_host, non_blocking=True)
        _synchronize()
        return 0

    def copy_pinned_chunks(self, store: bool) -> int:
        """One pinned host <-> device copy per chunk (the chunks' whole buffers): what per-chunk staging copies cost."""
        for host, device in zip(self.host_chunks, self.device_chunks):
            if store:
                host.copy_(device, non_blocking=True)
            else:
                device.copy_(host, non_blocking=True)
        _synchronize()
        return 0

    def cases(self, store: bool):
        return {
            "hand_over": self.timed_hand_over,
            "copy_d2d": lambda: self.copy_d2d(store),
            "ours_device": lambda: self.ours(self.device_chunks, store),
            "old_device": lambda: self.old(self.device_chunks, store),
            "copy_pinned": lambda: self.copy_pinned(store),
            "copy_pinned_chunks": lambda: self.copy_pinned_chunks(store),
            "ours_staged": lambda: self.ours(self.host_chunks, store),
            "old_host": lambda: self.old(self.host_chunks, store),
        }

    # ---- correctness ---------------------------------------------------------------
    def caches_bytes(self):
        return [plane.view(torch.uint8).clone() for planes in self.kv_caches.values() for plane in planes]

    def set_caches(self, snapshot):
        planes = [plane for planes in self.kv_caches.values() for plane in planes]
        for plane, saved in zip(planes, snapshot):
            plane.view(torch.uint8).copy_(saved)

    def check(self) -> dict:
        """Every path stores the same bytes and loads the same caches as the old path."""
        checked = {}
        original = self.caches_bytes()
        self.device_pool.fill_(0xA5)
        self.old(self.device_chunks, True)
        expected = self.device_pool.clone()
        assert int((expected != 0xA5).sum()) > 0, "the old path stored nothing"
        for path in ("device", "staged"):
            pool = self.device_pool if path == "device" else self.host_pool
            chunks = self.device_chunks if path == "device" else self.host_chunks
            pool.fill_(0xA5)  # the same poison: bytes no path writes must stay it
            self.ours(chunks, True)
            assert torch.equal(pool.to(self.device), expected), f"{self.name} store {path}"
            checked[f"store_{path}"] = "equal, whole pool"
        # Load: the stored chunks into poisoned caches, old path vs ours, whole caches compared.
        self.host_pool.copy_(expected.cpu())
        self.device_pool.copy_(expected)
        poisoned = [torch.full_like(saved, 0x3C) for saved in original]
        self.set_caches(poisoned)
        self.old(self.device_chunks, False)
        loaded_old = self.caches_bytes()
        assert any(not torch.equal(a, b) for a, b in zip(loaded_old, poisoned)), "the old path loaded nothing"
        for path in ("device", "staged"):
            self.set_caches(poisoned)
            chunks = self.device_chunks if path == "device" else self.host_chunks
            self.ours(chunks, False)
            for a, b in zip(self.caches_bytes(), loaded_old):
                assert torch.equal(a, b), f"{self.name} load {path}"
            checked[f"load_{path}"] = "equal, whole caches"
        self.set_caches(original)
        return checked


def host_breakdown(case: "RequestCase", store: bool = True, calls: int = 20) -> dict:
    """Host microseconds of each step of one batched request (device chunks), medians of `calls`."""
    from lmcache_ascend.kernels import chunk_buffers, resolve_chunk_batches, transfer_chunk_batches

    mover = case.mover
    steps: dict[str, list[float]] = {}

    def timed(label, fn):
        begin = time.perf_counter()
        value = fn()
        steps.setdefault(label, []).append((time.perf_counter() - begin) * 1e6)
        return value

    for _ in range(calls):
        _synchronize()
        begin = time.perf_counter()
        slots = timed("hand_over", case.hand_over)
        rows = timed("batch_rows", lambda: mover.batch_rows(slots, case.starts))
        buffers = timed("chunk_buffers", lambda: chunk_buffers(case.device_chunks))
        batches = timed("resolve_chunk_batches", lambda: resolve_chunk_batches(slots.slots, buffers, rows, store=store))
        timed("address_upload_and_launches", lambda: transfer_chunk_batches(batches))
        timed("issue_total", lambda: None)
        steps["issue_total"][-1] = (time.perf_counter() - begin) * 1e6
        timed("synchronize", _synchronize)
    result = {label: round(statistics.median(values), 1) for label, values in steps.items()}
    result["layer_groups"] = len(mover.paged_groups)
    return result


# Launch shapes the request-level tuning tries on every layer group (rows per program, row bytes
# per step, warps).
TUNE_SHAPES = ((64, 128, 4), (32, 128, 4), (16, 128, 4), (16, 256, 4), (32, 256, 4), (16, 512, 4), (64, 128, 8), (32, 128, 8),
               (128, 128, 8), (16, 256, 2), (64, 256, 8))


def _kernel_times(fn, name: str = "paged_chunks", calls: int = 5) -> list[float]:
    """Device microseconds of each `name` kernel one call of `fn` launches (in launch order), medians of `calls`."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    per_call = []
    for _ in range(calls):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
        kernels = sorted((event.time_range.start, event.device_time) for event in prof.events()
                         if event.device_type == torch.autograd.DeviceType.CUDA and name in event.name)
        per_call.append([duration for _, duration in kernels])
    return [round(statistics.median(values), 2) for values in zip(*per_call)]


def tune_request(case: "RequestCase") -> dict:
    """Kernel time of a request's multi-chunk launch (all layer groups in one) under each of `TUNE_SHAPES`,
    store and load, and the fastest shape."""
    from lmcache_ascend.kernels import triton_transfer as tt

    saved = tt.CHUNK_LAUNCH_SHAPES
    times: dict[str, dict[str, list[float]]] = {}
    try:
        for tile, segment, warps in TUNE_SHAPES:
            # Every launch takes this shape (the largest region of any group is below 2**40 bytes).
            tt.CHUNK_LAUNCH_SHAPES = ((2**40, tt.LaunchShape(tile, segment, warps)),)
            tt._chunks_launches.clear()
            label = f"{tile}/{segment}/{warps}"
            times[label] = {direction: _kernel_times(lambda: case.ours(case.device_chunks, direction == "store"))
                            for direction in ("store", "load")}
    finally:
        tt.CHUNK_LAUNCH_SHAPES = saved
        tt._chunks_launches.clear()
    totals = {label: sum(sum(entry[d]) for d in ("store", "load")) for label, entry in times.items()}
    return {"kernel_us": times, "best": min(totals, key=totals.get), "store_load_us": totals}


def staged_timeline(case: "RequestCase", store: bool, calls: int = 9, before=None) -> dict:
    """Where one staged request's time goes on the device, read from events around each staging copy
    (the profiler slows the host several times): when the first copy starts after the call begins, the
    idle gaps between copies, the copy engine's busy time, and the host's wait after the last copy;
    medians of `calls` requests (each right after `before()`, where given, and a synchronization)."""
    from lmcache_ascend.kv_worker import staging

    original = staging.StagedWaves.copy
    recorded: list = []

    def copy_between_events(self, spans, *, to_staging):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()  # on the copy stream: the call runs under its context
        original(self, spans, to_staging=to_staging)
        end.record()
        recorded.append((begin, end))

    samples = []
    case.ours(case.host_chunks, store)
    staging.StagedWaves.copy = copy_between_events
    try:
        for _ in range(calls):
            if before is not None:
                before()
            _synchronize()
            recorded.clear()
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            host_begin = time.perf_counter()
            case.ours(case.host_chunks, store)
            wall = (time.perf_counter() - host_begin) * 1e6
            spans = sorted((start.elapsed_time(b) * 1e3, start.elapsed_time(e) * 1e3) for b, e in recorded)
            samples.append({
                "first_copy_after_us": spans[0][0],
                "copy_gaps_us": sum(b[0] - a[1] for a, b in zip(spans, spans[1:])),
                "copy_busy_us": sum(e - b for b, e in spans),
                "after_last_copy_us": wall - spans[-1][1],
                "wall_us": wall,
                "copies": len(spans),
            })
    finally:
        staging.StagedWaves.copy = original
    return {key: round(statistics.median(sample[key] for sample in samples), 1) for key in samples[0]}


def _spread(samples):
    ordered = sorted(samples)
    return {"median_us": round(statistics.median(ordered), 1), "min_us": round(ordered[0], 1),
            "max_us": round(ordered[-1], 1),
            "p25_us": round(ordered[len(ordered) // 4], 1), "p75_us": round(ordered[(3 * len(ordered)) // 4], 1)}


def measure_request(device: torch.device, tokens: int = 16384, chunk_size: int = 256, rounds: int = 15,
                    tune: bool = False) -> dict:
    result = {"tokens": tokens, "chunk_size": chunk_size, "rounds": rounds, "layouts": {}}
    for name in LAYOUTS:
        case = RequestCase(name, tokens, chunk_size, device)
        entry = {"payload_bytes": case.payload, "chunks": len(case.starts),
                 "layer_groups": len(case.planner.layer_groups), "check": case.check()}
        entry["host_breakdown_us"] = host_breakdown(case)
        print(f"  request {name} host breakdown (us per request): {entry['host_breakdown_us']}", flush=True)
        # Diagnostics: a failure here is reported, and the timed comparison still runs.
        try:
            if tune:
                entry["tuning"] = tune_request(case)
                print(f"  request {name} tuning: {entry['tuning']}", flush=True)
            entry["staged_timeline"] = {d: staged_timeline(case, d == "store") for d in ("store", "load")}
            print(f"  request {name} staged timeline: {entry['staged_timeline']}", flush=True)
        except Exception as error:  # noqa: BLE001
            entry["diagnostics_error"] = repr(error)
            print(f"  request {name} diagnostics failed: {error!r}", flush=True)
        for store in (True, False):
            cases = case.cases(store)
            launches = {}
            for label, run in cases.items():  # warm-up (compiles, tables, staging) and launch counts
                run()
                launch_counter.reset()
                run()
                launches[label] = launch_counter.triton + launch_counter.torch
            samples = {label: [] for label in cases}
            labels = list(cases)
            for round_index in range(rounds):
                order = labels[round_index % len(labels):] + labels[: round_index % len(labels)]
                for label in order:
                    _synchronize()
                    begin = time.perf_counter()
                    cases[label]()
                    samples[label].append((time.perf_counter() - begin) * 1e6)
            stats = {label: {**_spread(values), "launches": launches[label]} for label, values in samples.items()}
            kernel = _kernel_time(lambda: case.ours(case.device_chunks, store))
            copy_kernel = _kernel_time(lambda: case.copy_d2d(store), copies=True)
            ratios = {
                "device_vs_copy_wall": stats["copy_d2d"]["median_us"] / stats["ours_device"]["median_us"],
                "device_vs_copy_kernel": copy_kernel / kernel if kernel else None,
                "staged_vs_pinned_copy": stats["copy_pinned"]["median_us"] / stats["ours_staged"]["median_us"],
                # A store's hand-over sits before its call (a load's is inside it).
                "staged_with_hand_over_vs_pinned_copy": stats["copy_pinned"]["median_us"]
                / (stats["ours_staged"]["median_us"] + (stats["hand_over"]["median_us"] if store else 0)),
                "pinned_chunks_vs_pinned_copy": stats["copy_pinned"]["median_us"] / stats["copy_pinned_chunks"]["median_us"],
                "old_device_vs_copy": stats["copy_d2d"]["median_us"] / stats["old_device"]["median_us"],
                "old_host_vs_pinned_copy": stats["copy_pinned"]["median_us"] / stats["old_host"]["median_us"],
                "device_speedup_vs_old": stats["old_device"]["median_us"] / stats["ours_device"]["median_us"],
            }
            entry["store" if store else "load"] = {
                "cases": stats, "kernel_us": kernel, "copy_kernel_us": copy_kernel,
                "ratios": {k: (round(v, 3) if v is not None else None) for k, v in ratios.items()},
            }
            print(f"  request {name} {'store' if store else 'load'}: "
                  + ", ".join(f"{k}={v:.3f}" for k, v in ratios.items() if v is not None), flush=True)
        result["layouts"][name] = entry
        del case
        torch.cuda.empty_cache()
    return result


def _kernel_time(fn, copies: bool = False) -> float:
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
    total = 0.0
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name.lower()
        if ("memcpy" in name or "memset" in name) and not copies:
            continue
        total += event.device_time
    return round(total, 2)


def print_request_table(result: dict) -> None:
    print(f"\nrequest of {result['tokens']} tokens in {result['chunk_size']}-token chunks (median us per request, "
          f"[p25, p75]; launches per request)")
    header = f"{'layout':<13}{'dir':<6}{'case':<13}{'median us':>11}{'p25':>10}{'p75':>10}{'GB/s':>8}{'launches':>9}"
    print(header)
    print("-" * len(header))
    for name, entry in result["layouts"].items():
        for direction in ("store", "load"):
            for label, stats in entry[direction]["cases"].items():
                gbps = entry["payload_bytes"] / stats["median_us"] / 1e3
                print(f"{name:<13}{direction:<6}{label:<13}{stats['median_us']:>11}{stats['p25_us']:>10}"
                      f"{stats['p75_us']:>10}{gbps:>8.1f}{stats['launches']:>9}")
            print(f"{'':<19}ratios: " + ", ".join(f"{k}={v}" for k, v in entry[direction]["ratios"].items()))
            flat = FLAT_KERNEL_VS_COPY.get(name, {}).get(direction)
            ratio = entry[direction]["ratios"]["device_vs_copy_kernel"]
            if flat is not None and ratio is not None:
                print(f"{'':<19}cost of the row-at-a-time kernel (the structure Ascend moves by DMA) on this device: "
                      f"kernel / copy kernel {ratio} here; the flat per-vector kernel it replaced had {flat} "
                      "(one H100, 16K-token request)")
