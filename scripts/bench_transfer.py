#!/usr/bin/env python3
"""Benchmark the paged <-> chunk transfer ops; print a table and write JSON.

For each layout ((a) DeepSeek-V4-like bundled multi-plane group, (b) plain MLA)
and chunk size, in ONE process and on the same buffers:
  * ours: `transfer_group` (the public entry, validation included) on the
    device's backend (Triton on CUDA, the torch reference on CPU);
  * roofline: a torch device-to-device copy of the same number of bytes;
  * index path: torch `index_select(out=)` / `index_copy_`, one op per (layer, plane);
  * exploded: our op with one launch per (layer, plane) instead of one per group.
GB/s count the KV payload once (bytes read = bytes written). Wall time: CUDA
events around back-to-back calls (median of repeats); on CUDA the kernel-only
time comes from the torch profiler. Launches per chunk are counted from the
profiler's kernel records (CUDA) or the op's launch counter.

On CUDA it first checks the Triton kernel against the contract and the torch
reference, byte for byte, on generated layouts (--check N), then runs the
whole-request benchmark of `_bench_request.py` (--request-tokens, default a 16K
request in 256-token chunks): the batched path against the old per-chunk path
and against same-byte device and pinned host copies, each path's bytes checked
against the old path's first.

    python scripts/bench_transfer.py                  # picks cuda if present
    python scripts/bench_transfer.py --device cpu     # the reference, for the record
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from lmcache_ascend.kernels import (  # noqa: E402
    PagedGroup,
    PagedPlane,
    PlaneSlots,
    launch_counter,
    resolve_transfer,
    transfer_group,
)


@dataclass
class Row:
    case_name: str
    tokens: int
    direction: str
    payload_bytes: int
    ours_us: float
    host_us: float  # CPU time one call of ours takes to issue (validation, table, launch)
    ours_gbps: float
    copy_gbps: float
    index_gbps: float
    exploded_gbps: float
    vs_copy: float
    vs_index: float
    kernel_us: float | None
    kernel_gbps: float | None
    copy_kernel_gbps: float | None
    vs_copy_kernel: float | None
    launches_bundled: int
    launches_exploded: int


@dataclass
class PlaneSpec:
    name: str
    dtype: torch.dtype
    row_elements: int
    block_size: int
    compress_ratio: int


# (a) DeepSeek-V4-like layer group (vllm-ascend, v0.18 era, as the seeds describe
# it): per layer a tuple of planes with different dtypes and block sizes; the
# indexer K (int8, 128) and its fp16 scale (width 1) are views of one int8 blob.
DSV4_PLANES = (
    PlaneSpec("c4_kv_fp8_nope_bf16_rope", torch.float8_e4m3fn, 448 + 2 * 64, 64, 4),
    PlaneSpec("c4_indexer_k_int8", torch.int8, 128, 64, 4),
    PlaneSpec("c4_indexer_scale_fp16", torch.float16, 1, 64, 4),
)
DSV4_LAYERS = 30
# (b) plain MLA (DeepSeek-V3 style): bf16 latent 512 + rope 64, one plane.
MLA_PLANES = (PlaneSpec("mla_latent_rope_bf16", torch.bfloat16, 576, 64, 1),)
MLA_LAYERS = 61


def build_case(planes: tuple[PlaneSpec, ...], layers: int, tokens: int, device: torch.device, blob: bool):
    """Caches filled with random bytes, scattered block tables, slots; all planes valid."""
    generator = torch.Generator(device="cpu").manual_seed(tokens)
    counts = [-(-tokens // spec.compress_ratio) for spec in planes]
    blocks_needed = max(-(-count // spec.block_size) for count, spec in zip(counts, planes))
    num_blocks = 2 * blocks_needed + 1
    caches: list[list[torch.Tensor]] = [[] for _ in planes]
    for _ in range(layers):
        if blob:
            sizes = [spec.block_size * spec.row_elements * torch.empty((), dtype=spec.dtype).element_size() for spec in planes]
            block_bytes = -(-sum(sizes) // 64) * 64
            storage = torch.randint(-128, 128, (num_blocks, block_bytes), dtype=torch.int8, device=device)
            offset = 0
            for index, (spec, size) in enumerate(zip(planes, sizes)):
                view = storage[:, offset : offset + size].view(spec.dtype)
                caches[index].append(view.view(num_blocks, spec.block_size, spec.row_elements))
                offset += size
        else:
            for index, spec in enumerate(planes):
                raw = torch.randint(0, 256, (num_blocks, spec.block_size, spec.row_elements * torch.empty((), dtype=spec.dtype).element_size()),
                                    dtype=torch.uint8, device=device)
                caches[index].append(raw.view(spec.dtype))
    group = PagedGroup(tuple(
        PagedPlane(caches[index], spec.block_size, spec.row_elements * caches[index][0].element_size(), name=spec.name)
        for index, spec in enumerate(planes)
    ))
    slots = []
    for spec, count in zip(planes, counts):
        block_ids = torch.randperm(num_blocks - 1, generator=generator)[: -(-count // spec.block_size)] + 1
        positions = torch.arange(count)
        slots.append(PlaneSlots((block_ids[positions // spec.block_size] * spec.block_size + positions % spec.block_size).to(device)))
    regions = group.chunk_regions([s.count for s in slots])
    chunk = torch.randint(0, 256, (regions.total_bytes,), dtype=torch.uint8, device=device)
    payload = sum(count * plane.row_bytes for count, plane in zip(counts, group.planes)) * layers
    return group, tuple(slots), chunk, regions, payload


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def wall_time_us(fn, device: torch.device, calls: int, repeats: int) -> float:
    """Median over repeats of (time for `calls` back-to-back calls) / calls, in microseconds."""
    fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1000.0 / calls)
        else:
            begin = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - begin) * 1e6 / calls)
    return statistics.median(samples)


def profile_kernels(fn, name_contains: tuple[str, ...] | None = None, with_copies: bool = False) -> tuple[int, float]:
    """(kernel launches, summed kernel device time in us) of one call of `fn`, from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    launches, total = 0, 0.0
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name.lower()
        if ("memcpy" in name or "memset" in name) and not with_copies:
            continue  # a table upload (first call of a chunk shape only) is not a kernel launch
        if name_contains and not any(part in name for part in name_contains):
            continue
        launches += 1
        total += event.device_time
    return launches, total


def index_path(group, slots, chunk, regions, store: bool):
    """The torch baseline: one index op per (layer, plane), natural dtypes.

    Contiguous caches: index_select(out=) / index_copy_ on [rows, row] views; blob
    views (strided blocks): advanced indexing by (block, row-in-block), the block
    and row indices computed once, outside the timed calls.
    """
    ops = []
    for layer in range(group.layer_count):
        for index, (plane, plane_slots) in enumerate(zip(group.planes, slots)):
            cache = plane.caches[layer]
            start = regions.region_offset(layer, index)
            region_bytes = chunk[start : start + plane_slots.count * plane.row_bytes]
            if cache.is_contiguous():
                rows = cache.reshape(-1, plane.row_bytes // cache.element_size())
                region = region_bytes.view(rows.dtype).view(plane_slots.count, -1)
                ops.append(("rows", rows, plane_slots.slots, region))
            else:
                paged = group.geometry[layer][index].byte_view(cache, plane.block_size, plane.row_bytes)
                blocks = torch.div(plane_slots.slots, plane.block_size, rounding_mode="floor")
                offsets = plane_slots.slots - blocks * plane.block_size
                ops.append(("blocks", paged, (blocks, offsets), region_bytes.view(plane_slots.count, -1)))

    def run():
        for kind, paged, where, region in ops:
            if kind == "rows":
                if store:
                    torch.index_select(paged, 0, where, out=region)
                else:
                    paged.index_copy_(0, where, region)
            elif store:
                region.copy_(paged[where])
            else:
                paged.index_put_(where, region)

    return run


def exploded(group, slots, chunk, regions, store: bool, backend: str | None):
    """Our op with one launch per (layer, plane): what an unbundled layout costs."""
    pieces = []
    for layer in range(group.layer_count):
        for index, plane in enumerate(group.planes):
            single = PagedGroup((PagedPlane((plane.caches[layer],), plane.block_size, plane.row_bytes),))
            pieces.append((single, slots[index], regions.region_offset(layer, index)))

    def run():
        for single, plane_slots, offset in pieces:
            transfer_group(single, (plane_slots,), chunk, store=store, chunk_offset=offset, backend=backend)

    return run, len(pieces)


def check_triton_on_device(examples: int, device: torch.device) -> dict:
    """Triton vs the independent expectation and vs the torch reference, byte exact, on `device`."""
    from hypothesis import HealthCheck, given, settings

    from tests.kernels._cases import build, transfer_cases, poisoned_chunk
    from tests.kernels.test_transfer_roundtrip import round_trip

    import dataclasses

    from tests.kernels._regressions import MINIMAL_OUT_OF_RANGE, out_of_range_slot_cases

    checked = {"examples": 0, "store_equal_reference": 0, "load_equal_reference": 0}
    # The fixed cases of past failures first (the out-of-range slot with poisoned neighbours).
    checked["regressions"] = out_of_range_slot_cases("triton", str(device))
    for seed in range(4):
        round_trip(dataclasses.replace(MINIMAL_OUT_OF_RANGE, seed=seed), backend="triton", device=str(device))
        checked["regressions"] += 1

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=transfer_cases(max_tokens=300, max_layers=3))
    def check(case):
        round_trip(case, backend="triton", device=str(device))
        for store in (True, False):
            built = [build(case, device=str(device), seed_offset=2) for _ in range(2)]
            chunks = [poisoned_chunk(built[0].chunk_bytes, case.seed + 5, device=str(device)) for _ in range(2)]
            for which, backend in enumerate(("triton", "torch")):
                transfer_group(built[which].group, built[which].slots, chunks[which], store=store,
                               chunk_offset=case.chunk_offset, alignment=case.alignment, backend=backend)
            synchronize(device)
            assert torch.equal(chunks[0], chunks[1])
            for a, b in zip(built[0].storages, built[1].storages):
                assert torch.equal(a, b)
            checked["store_equal_reference" if store else "load_equal_reference"] += 1
        checked["examples"] += 1

    check()
    return checked


def tune(device: torch.device) -> list[dict]:
    """Kernel-only time of a few tile shapes on the large MLA and DSv4 layouts."""
    from lmcache_ascend.kernels import triton_transfer as tt

    results = []
    for name, planes, layers, blob in (("mla", MLA_PLANES, MLA_LAYERS, False), ("dsv4", DSV4_PLANES, DSV4_LAYERS, True)):
        group, slots, chunk, regions, payload = build_case(planes, layers, 8192, device, blob)
        for store in (True, False):
            transfer = resolve_transfer(group, slots, chunk, store=store)
            for tile, segment, warps in ((64, 128, 4), (32, 256, 4), (16, 512, 4), (8, 1024, 4), (4, 2048, 4),
                                         (128, 128, 8), (32, 128, 4), (16, 256, 2)):
                _, kernel_us = profile_kernels(
                    lambda: tt.triton_transfer(transfer, shape=tt.LaunchShape(tile, segment, warps)),
                    ("paged_chunk",),
                )
                results.append({"layout": name, "store": store, "tile": tile, "segment": segment,
                                "warps": warps, "kernel_us": round(kernel_us, 2),
                                "kernel_gbps": round(payload / kernel_us / 1e3, 1)})
            src = torch.empty(payload, dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            _, copy_us = profile_kernels(lambda: dst.copy_(src), with_copies=True)
            results.append({"layout": name, "store": store, "baseline": "torch copy", "kernel_us": round(copy_us, 2),
                            "kernel_gbps": round(payload / copy_us / 1e3, 1)})
    return results


def host_breakdown(device: torch.device, calls: int = 500) -> dict:
    """CPU microseconds per call of each host-side step, on the 256-token MLA chunk."""
    from lmcache_ascend.kernels import select_backend
    from lmcache_ascend.kernels import launcher
    from lmcache_ascend.kernels import triton_transfer as tt

    group, slots, chunk, regions, _ = build_case(MLA_PLANES, MLA_LAYERS, 256, device, False)

    def per_call(fn) -> float:
        fn()
        synchronize(device)
        begin = time.perf_counter()
        for _ in range(calls):
            fn()
        spent = (time.perf_counter() - begin) * 1e6 / calls
        synchronize(device)
        return round(spent, 2)

    transfer = resolve_transfer(group, slots, chunk, store=True)
    result = {
        "select_backend": per_call(lambda: select_backend(device)),
        "resolve_transfer": per_call(lambda: resolve_transfer(group, slots, chunk, store=True)),
        "device_table_lookup": per_call(lambda: tt._device_table(group, transfer.regions, 0, chunk.data_ptr())),
        "triton_transfer_raw_launch": per_call(lambda: tt.triton_transfer(transfer)),
    }
    launcher._raw_launch["enabled"] = False
    result["triton_transfer_runner_launch"] = per_call(lambda: tt.triton_transfer(transfer))
    launcher._direct_launch["enabled"] = False
    result["triton_transfer_jit_launch"] = per_call(lambda: tt.triton_transfer(transfer))
    launcher._direct_launch["enabled"] = True
    launcher._raw_launch["enabled"] = True
    result["transfer_group_total"] = per_call(lambda: transfer_group(group, slots, chunk, store=True))
    # A bare launch of an empty Triton kernel through the same direct path: the floor.
    try:
        result["empty_kernel_direct_launch"] = per_call(_empty_kernel_launcher(device))
    except Exception as error:  # noqa: BLE001 - a reference number only; never lose the run for it
        result["empty_kernel_direct_launch"] = f"failed: {error!r}"[:200]
    return result


def _empty_kernel_launcher(device: torch.device):
    import triton
    import triton.language as tl

    @triton.jit
    def _empty(pointer, value):
        if value < 0:
            tl.store(pointer, value)

    probe = torch.zeros(1, dtype=torch.int64, device=device)
    compiled = _empty[(1,)](probe, 5)
    return lambda: compiled[(1, 1, 1)](probe, 5)


def measure(device: torch.device, token_counts: list[int], calls: int, repeats: int) -> list[Row]:
    backend = None  # the device's default choice (Triton on CUDA, reference on CPU)
    rows: list[Row] = []
    for name, planes, layers, blob in (("dsv4_bundled", DSV4_PLANES, DSV4_LAYERS, True), ("mla", MLA_PLANES, MLA_LAYERS, False)):
        for tokens in token_counts:
            group, slots, chunk, regions, payload = build_case(planes, layers, tokens, device, blob)
            src = torch.randint(0, 256, (payload,), dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            copy_us = wall_time_us(lambda: dst.copy_(src), device, calls, repeats)
            for store in (True, False):
                ours = lambda: transfer_group(group, slots, chunk, store=store, backend=backend)  # noqa: E731
                ours_us = wall_time_us(ours, device, calls, repeats)
                synchronize(device)
                issued = time.perf_counter()
                for _ in range(calls):
                    ours()
                host_us = (time.perf_counter() - issued) * 1e6 / calls
                synchronize(device)
                index_us = wall_time_us(index_path(group, slots, chunk, regions, store), device, calls, repeats)
                exploded_run, exploded_launches = exploded(group, slots, chunk, regions, store, backend)
                exploded_us = wall_time_us(exploded_run, device, max(1, calls // 4), repeats)
                kernel_us = kernel_gbps = copy_kernel_gbps = vs_copy_kernel = None
                if device.type == "cuda":
                    launches, kernel_us = profile_kernels(ours)
                    exploded_counted, _ = profile_kernels(exploded_run)
                    _, copy_kernel_us = profile_kernels(lambda: dst.copy_(src), with_copies=True)
                    kernel_gbps = payload / kernel_us / 1e3
                    copy_kernel_gbps = payload / copy_kernel_us / 1e3
                    vs_copy_kernel = copy_kernel_us / kernel_us
                else:
                    launch_counter.reset()
                    ours()
                    launches = launch_counter.torch + launch_counter.triton
                    launch_counter.reset()
                    exploded_run()
                    exploded_counted = launch_counter.torch + launch_counter.triton
                assert exploded_counted == exploded_launches, (exploded_counted, exploded_launches)
                rows.append(Row(
                    case_name=name, tokens=tokens, direction="store" if store else "load", payload_bytes=payload,
                    ours_us=round(ours_us, 2), host_us=round(host_us, 2), ours_gbps=round(payload / ours_us / 1e3, 1),
                    copy_gbps=round(payload / copy_us / 1e3, 1), index_gbps=round(payload / index_us / 1e3, 1),
                    exploded_gbps=round(payload / exploded_us / 1e3, 1),
                    vs_copy=round(copy_us / ours_us, 3), vs_index=round(index_us / ours_us, 2),
                    kernel_us=None if kernel_us is None else round(kernel_us, 2),
                    kernel_gbps=None if kernel_gbps is None else round(kernel_gbps, 1),
                    copy_kernel_gbps=None if copy_kernel_gbps is None else round(copy_kernel_gbps, 1),
                    vs_copy_kernel=None if vs_copy_kernel is None else round(vs_copy_kernel, 3),
                    launches_bundled=launches, launches_exploded=exploded_counted,
                ))
                print(f"  {name} T={tokens} {rows[-1].direction}: {rows[-1].ours_gbps} GB/s", flush=True)
    return rows


def print_table(rows: list[Row]) -> None:
    header = (f"{'regions':<13}{'T':>6} {'dir':<6}{'MB':>8} {'ours us':>9} {'host us':>8}{'GB/s':>8}{'copy':>8}{'index':>8}"
              f"{'explod':>8}{'/copy':>7}{'/index':>7}{'kern GB/s':>10}{'kern/copyk':>11}{'launch b/e':>11}")
    print(header)
    print("-" * len(header))
    for r in rows:
        kern = f"{r.kernel_gbps:>10}" if r.kernel_gbps is not None else f"{'-':>10}"
        kern_ratio = f"{r.vs_copy_kernel:>11}" if r.vs_copy_kernel is not None else f"{'-':>11}"
        print(f"{r.case_name:<13}{r.tokens:>6} {r.direction:<6}{r.payload_bytes / 1e6:>8.2f} {r.ours_us:>9} {r.host_us:>8}{r.ours_gbps:>8}"
              f"{r.copy_gbps:>8}{r.index_gbps:>8}{r.exploded_gbps:>8}{r.vs_copy:>7}{r.vs_index:>7}{kern}{kern_ratio}"
              f"{f'{r.launches_bundled}/{r.launches_exploded}':>11}")


def memory_object_reads(objects: int, rounds: int) -> dict:
    """Host time to reach the bytes of `objects` LMCache tensor memory objects, as the connector does per
    batched call: its ``tensor`` property (three views per object) vs ``raw_tensor`` (what
    `MultiGroupGPUConnector._memory_bytes` reads), each followed by `chunk_buffers`. Real
    `TensorMemoryObj`s sliced from one buffer like LMCache's allocator does; cases interleaved."""
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    from lmcache_ascend.connector.multigroup_connector import MultiGroupGPUConnector
    from lmcache_ascend.kernels import chunk_buffers

    shape = torch.Size((1, 1, 256, 22710))  # the DSv4-like chunk of _bench_request.py (5.8 MB)
    size = shape.numel()
    aligned = -(-size // 4096) * 4096
    pool = torch.empty(objects * aligned, dtype=torch.uint8)
    memory_objs = [
        TensorMemoryObj(pool[i * aligned : i * aligned + size],
                        MemoryObjMetadata(shape=shape, dtype=torch.uint8, address=i * aligned, phy_size=aligned,
                                          ref_count=1, fmt=MemoryFormat.KV_2LTD), None)
        for i in range(objects)
    ]
    connector = MultiGroupGPUConnector(256)

    def via_tensor():
        chunks = []
        for memory_obj in memory_objs:
            tensor = memory_obj.tensor
            if not tensor.is_contiguous():
                raise AssertionError("not contiguous")
            chunks.append(tensor.reshape(-1).view(torch.uint8))
        return chunk_buffers(chunks)

    def via_raw():
        return chunk_buffers([connector._memory_bytes(memory_obj, 0, 256, size) for memory_obj in memory_objs])

    assert np.array_equal(via_tensor().addresses, via_raw().addresses)
    cases = {"tensor_property": via_tensor, "raw_tensor": via_raw}
    samples = {label: [] for label in cases}
    for round_index in range(rounds):
        for label in (list(cases) if round_index % 2 == 0 else list(cases)[::-1]):
            begin = time.perf_counter()
            cases[label]()
            samples[label].append((time.perf_counter() - begin) * 1e6)
    result = {"objects": objects, "rounds": rounds}
    for label, values in samples.items():
        ordered = sorted(values)
        result[label] = {"median_us": round(statistics.median(ordered), 1), "p25_us": round(ordered[len(ordered) // 4], 1),
                         "p75_us": round(ordered[(3 * len(ordered)) // 4], 1)}
    result["ratio_tensor_over_raw"] = round(result["tensor_property"]["median_us"] / result["raw_tensor"]["median_us"], 2)
    return result


def _git_commit() -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", default=None, help="comma-separated chunk sizes in tokens")
    parser.add_argument("--calls", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--check", type=int, default=200, help="generated layouts to check Triton on (CUDA)")
    parser.add_argument("--tune", action="store_true", help="also time a few tile shapes (CUDA)")
    parser.add_argument("--out", default=None, help="JSON path (default results/bench_transfer_<device>.json)")
    parser.add_argument("--request-tokens", type=int, default=16384,
                        help="tokens of the whole-request benchmark (CUDA; 0 skips it)")
    parser.add_argument("--request-rounds", type=int, default=15)
    parser.add_argument("--skip-chunks", action="store_true", help="only the whole-request benchmark")
    parser.add_argument("--tune-request", action="store_true",
                        help="also time each layer group's multi-chunk launch under a few launch shapes (CUDA)")
    parser.add_argument("--memory-objects", type=int, default=0,
                        help="only time reading N LMCache memory objects' bytes, tensor property vs raw_tensor "
                             "(needs LMCache; any device)")
    args = parser.parse_args()
    if args.memory_objects:
        result = memory_object_reads(args.memory_objects, 201)
        print(f"{'case':<18}{'median us':>11}{'p25':>9}{'p75':>9}   ({args.memory_objects} memory objects, 201 rounds)")
        for label in ("tensor_property", "raw_tensor"):
            entry = result[label]
            print(f"{label:<18}{entry['median_us']:>11}{entry['p25_us']:>9}{entry['p75_us']:>9}")
        print(f"tensor_property / raw_tensor: {result['ratio_tensor_over_raw']}x")
        out = Path(args.out) if args.out else REPO / "results" / "bench_memory_objects.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**result, "torch": torch.__version__, "commit": _git_commit()}, indent=2))
        print(f"wrote {out}")
        return
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else ([256, 1024, 4096, 16384] if on_cuda else [256, 1024])
    calls = args.calls or (20 if on_cuda else 3)
    result: dict = {
        "device": torch.cuda.get_device_name(device) if on_cuda else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "backend": "triton" if on_cuda else "torch-reference",
        "payload_note": "GB/s count KV payload bytes once (read = written); copy = torch d2d copy of the same bytes",
        "commit": os.environ.get("BENCH_COMMIT") or _git_commit(),
    }
    if on_cuda:
        import triton

        result["triton"] = triton.__version__
        if args.check:
            started = time.perf_counter()
            result["triton_check"] = check_triton_on_device(args.check, device)
            result["triton_check"]["seconds"] = round(time.perf_counter() - started, 1)
            print("triton check:", result["triton_check"], flush=True)
        if args.tune:
            result["tuning"] = tune(device)
            for entry in result["tuning"]:
                print("tune", entry, flush=True)
    if on_cuda:
        result["host_breakdown_us"] = host_breakdown(device)
        print("host breakdown (us per call):", result["host_breakdown_us"], flush=True)
    if on_cuda and args.request_tokens:
        from _bench_request import measure_request, print_request_table

        result["request"] = measure_request(device, args.request_tokens, 256, args.request_rounds, args.tune_request)
    rows = [] if args.skip_chunks else measure(device, tokens, calls, args.repeats)
    result["rows"] = [asdict(row) for row in rows]
    if rows:
        print_table(rows)
    if "request" in result:
        print_request_table(result["request"])
    out = Path(args.out) if args.out else REPO / "results" / f"bench_transfer_{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    extra = os.environ.get("OUT")
    if extra:
        Path(extra, out.name).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
