#!/usr/bin/env python
"""Slots of one request: built on the scheduler and shipped (before issue 13 item 2) vs block ids
shipped and resolved on the worker's device (now), same request, cases interleaved.

- ``old``: the scheduler builds every transferred group's slot tensor (`tests/multigroup/cpu_slots`,
  the builder it ran before), pickles them, the worker unpickles and uploads them
  (`DeviceSlots.upload`, one host-to-device copy), for a store and for a load;
- ``ours``: the scheduler takes the ids (`step_block_ids`), pickles them, the worker unpickles and
  resolves them (`DeviceSlots.from_block_ids`) for a store and for a load: on a device the
  transfers run Triton on, expanded there (`kernels.block_slots`);
- ``ours_host``: the same with the worker's expansion on the host (numpy, then one copy), as on
  a device without Triton (`backend="torch"`).

Per part, medians over rounds [q1-q3] in us (the device is synchronized before a worker part ends)
and the ratio ours / old of the same round. Prints a table, writes JSON.

Usage: python scripts/bench_slot_resolution.py [--tokens N] [--rounds N] [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from lmcache_ascend.kv_worker.device_slots import DeviceSlots  # noqa: E402
from lmcache_ascend.multigroup.slots import step_block_ids  # noqa: E402
from lmcache_ascend.multigroup.specs import KVGroupSpec, kv_groups_from_specs  # noqa: E402
from lmcache_ascend.multigroup.state_skip import StateGroupPolicy  # noqa: E402
from lmcache_ascend.multigroup.tracker import GroupBlockTracker  # noqa: E402
from tests.multigroup.cpu_slots import build_group_slot_mappings  # noqa: E402

# (class name, block size, compress ratio, window, is_state)
LAYOUTS = {
    "dsv4_cuda_5": (("Full", 256, 1, None, False), ("C4", 64, 1, None, False), ("C4I", 64, 1, None, False),
                    ("C1", 4, 1, None, False), ("SWA", 8, 1, 128, False)),
    "dsv4_ascend_like": (("C4AttnKV", 512, 4, None, False), ("C128AttnKV", 16384, 128, None, False),
                         ("C1AttnKV", 128, 1, None, False), ("C4IndexerKV", 512, 4, None, False),
                         ("C4AttnKVState", 128, 1, None, True), ("SWA", 16384, 128, 128, False)),
    "mla_1": (("MLAAttention", 64, 1, None, False),),
}
CHUNK = 256
KINDS = ("old", "ours_host", "ours")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def case_setup(name: str, tokens: int):
    groups = tuple(KVGroupSpec(i, c, b, r, w, is_state=s) for i, (c, b, r, w, s) in enumerate(LAYOUTS[name]))
    kv_groups = kv_groups_from_specs(groups, min(g.block_size for g in groups), StateGroupPolicy())
    tables = tuple([1 + 100_000 * g.group_index + i for i in range(g.num_blocks(tokens))] for g in groups)
    return kv_groups, tables


def run_once(kind: str, kv_groups, tables, tokens: int, device: torch.device) -> dict[str, float]:
    tracker = GroupBlockTracker.for_new_request(tables, kv_groups.num_groups)  # fresh: nothing cached
    registered = kv_groups.groups_by_index()
    cached = tokens // 2
    times = {}
    begin = time.perf_counter()
    if kind == "old":
        shipped = build_group_slot_mappings(kv_groups, tracker, tokens, CHUNK, cached)
    else:
        shipped = step_block_ids(kv_groups, tracker, tokens, CHUNK, cached)
    times["scheduler"] = time.perf_counter() - begin
    begin = time.perf_counter()
    payload = pickle.dumps(shipped, protocol=pickle.HIGHEST_PROTOCOL)
    times["pickle"] = time.perf_counter() - begin
    times["bytes"] = len(payload)
    received = pickle.loads(payload)
    sync(device)
    begin = time.perf_counter()
    if kind == "old":
        store = DeviceSlots.upload(received.transferred_slot_mappings(), registered, device)
        load = DeviceSlots.upload(received.transferred_slot_mappings(), registered, device, received.vllm_cached_tokens)
    else:
        backend = "torch" if kind == "ours_host" else None
        store = DeviceSlots.from_block_ids(received, kv_groups, device, backend=backend)
        load = DeviceSlots.from_block_ids(received, kv_groups, device, received.vllm_cached_tokens, backend=backend)
    sync(device)
    times["worker"] = time.perf_counter() - begin
    times["_slots"] = (store.slots, load.slots)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=str(REPO / "results" / "bench_slot_resolution.json"))
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = []
    for name in LAYOUTS:
        kv_groups, tables = case_setup(name, args.tokens)
        # Same slots, every element, before timing.
        old = run_once("old", kv_groups, tables, args.tokens, device)
        for kind in KINDS[1:]:
            for a, b in zip(old["_slots"], run_once(kind, kv_groups, tables, args.tokens, device)["_slots"]):
                assert torch.equal(a.cpu(), b.cpu()), f"{name}: {kind}'s slots differ from the old builder's"
        samples = {kind: [] for kind in KINDS}
        for round_index in range(args.rounds):
            shift = round_index % len(KINDS)
            for kind in KINDS[shift:] + KINDS[:shift]:
                samples[kind].append(run_once(kind, kv_groups, tables, args.tokens, device))
        for part in ("scheduler", "pickle", "worker"):
            row = {"case": name, "part": part}
            for kind in KINDS:
                values = [s[part] * 1e6 for s in samples[kind]]
                q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
                row[kind] = {"median": q2, "q1": q1, "q3": q3}
            ratios = [o[part] / b[part] for o, b in zip(samples["ours"], samples["old"])]
            q1, q2, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
            row["ratio"] = {"median": q2, "q1": q1, "q3": q3}
            rows.append(row)
        rows.append({"case": name, "part": "bytes", **{kind: samples[kind][0]["bytes"] for kind in KINDS}})
    print(f"slots of one {args.tokens}-token request (chunk {CHUNK}, load with half cached), device {device}, "
          f"{args.rounds} rounds interleaved; us: median [q1-q3]; ratio: median of per-round ours / old")
    print(f"{'case':<17} {'part':<9} | {'old us':>24} | {'ours_host us':>24} | {'ours us':>24} | {'ours/old':>18}")
    for row in rows:
        if row["part"] == "bytes":
            print(f"{row['case']:<17} {'pickled':<9} | {row['old']:>21} B  | {row['ours_host']:>21} B  | "
                  f"{row['ours']:>21} B  |")
            continue
        cell = lambda e: f"{e['median']:.1f} [{e['q1']:.1f}-{e['q3']:.1f}]".rjust(24)  # noqa: E731
        ratio = row["ratio"]
        print(f"{row['case']:<17} {row['part']:<9} | {cell(row['old'])} | {cell(row['ours_host'])} | {cell(row['ours'])} | "
              f"{ratio['median']:.2f} [{ratio['q1']:.2f}-{ratio['q3']:.2f}]".rstrip())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "bench_slot_resolution", "args": vars(args), "device": str(device),
                               "torch": torch.__version__, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
