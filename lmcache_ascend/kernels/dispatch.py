"""Where a transfer runs: the entry points that dispatch a launch to a backend, and the per-device backend choice."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from lmcache_ascend.kernels.reference import reference_transfer
from lmcache_ascend.kernels.paged import PagedGroup
from lmcache_ascend.kernels.resolve import (
    PlaneSlots,
    ResolvedChunkBatch,
    resolve_transfer,
)
from lmcache_ascend.kernels.spec import (
    DEFAULT_REGION_ALIGNMENT,
    ChunkRegions,
    TransferError,
    triton_interpreting,
)
from lmcache_ascend.kernels.torch_batch import torch_transfer_chunks

__all__ = [
    "BACKENDS",
    "LaunchCounter",
    "launch_counter",
    "prepare_chunks_relaunch",
    "prepare_relaunch",
    "select_backend",
    "transfer_chunk_batches",
    "transfer_group",
]

logger = logging.getLogger(__name__)

BACKENDS = ("torch", "triton")


@dataclass
class LaunchCounter:
    """How many transfers each backend ran (one Triton call = one kernel launch)."""

    triton: int = 0
    torch: int = 0

    def reset(self) -> None:
        self.triton = 0
        self.torch = 0


launch_counter = LaunchCounter()


# Whether Triton can run on a device type, per (device type, interpreting):
# answered once per process (importing Triton and probing its driver is slow).
_triton_usable: dict[tuple[str, bool], bool] = {}


def _triton_available_for(device: torch.device) -> bool:
    key = (device.type, triton_interpreting())
    usable = _triton_usable.get(key)
    if usable is None:
        try:
            from lmcache_ascend.kernels import triton_transfer
        except ImportError:
            usable = False
        else:
            usable = triton_transfer.supports_device(device)
        _triton_usable[key] = usable
    return usable


def select_backend(device: torch.device, requested: str | None = None) -> str:
    """The backend a transfer on `device` runs on.

    `requested` (None = "auto"; callers pass the user's choice, the kernels read no
    flag): "torch" always gives the reference; "triton" gives Triton or raises if it
    cannot run there; "auto" gives Triton on CUDA and on NPU (triton-ascend) when it
    is importable, the reference elsewhere (CPU, or no Triton).
    """
    choice = "auto" if requested is None else requested
    # The answer depends only on these (Triton's usability is fixed per process):
    # remembered, since it is asked on every transfer.
    key = (device, choice, triton_interpreting())
    selected = _selected_backends.get(key)
    if selected is None:
        selected = _select_backend(device, choice)
        _selected_backends[key] = selected  # bad choices raised above and are never stored
    return selected


_selected_backends: dict[tuple, str] = {}


def _select_backend(device: torch.device, choice: str) -> str:
    if choice not in ("auto", *BACKENDS):
        raise TransferError(f"backend={choice!r} is not allowed; allowed: auto, torch, triton")
    if choice == "torch":
        return "torch"
    if device.type in ("cuda", "npu") or (device.type == "cpu" and triton_interpreting()):
        if _triton_available_for(device):
            return "triton"
    if choice == "triton":
        raise TransferError(
            f"backend 'triton' cannot run on device {device}: Triton needs a CUDA or NPU device "
            "(triton-ascend on NPU), or TRITON_INTERPRET=1 on CPU"
        )
    if device.type in ("cuda", "npu"):
        # Once per device and choice (the answer is remembered).
        logger.warning("Triton is not usable on %s; transfers use the slower torch reference", device)
    return "torch"


def transfer_group(
    group: PagedGroup,
    slots: Sequence[PlaneSlots],
    chunk: torch.Tensor,
    *,
    store: bool,
    chunk_offset: int = 0,
    alignment: int = DEFAULT_REGION_ALIGNMENT,
    backend: str | None = None,
    regions: ChunkRegions | None = None,
) -> None:
    """Move all planes of all layers of `group` between the paged caches and `chunk`.

    `store=True`: paged -> chunk; False: chunk -> paged. One kernel launch on the
    Triton backend. See the package docstring for the exact contract.
    """
    transfer = resolve_transfer(
        group, slots, chunk, store=store, chunk_offset=chunk_offset, alignment=alignment, regions=regions
    )
    if select_backend(group.device, backend) == "triton":
        from lmcache_ascend.kernels.triton_transfer import triton_transfer

        triton_transfer(transfer)
        launch_counter.triton += 1
    else:
        reference_transfer(transfer)
        launch_counter.torch += 1


def prepare_relaunch(
    group: PagedGroup,
    slots: Sequence[PlaneSlots],
    chunk: torch.Tensor,
    *,
    store: bool,
    regions: ChunkRegions | None = None,
    backend: str | None = None,
):
    """The launch `transfer_group` made with these arguments, as a function of (chunk address, slot
    address) that makes it again over other buffers of the same shapes and returns True, or
    launches nothing and returns False for addresses aligned otherwise (see
    `triton_transfer.Relaunch`); None where there is no such launch (not the Triton backend, no
    direct launch on this device, or nothing to move)."""
    if select_backend(group.device, backend) != "triton":
        return None
    from lmcache_ascend.kernels.triton_transfer import prepare_relaunch as prepare

    return _counted(prepare(resolve_transfer(group, slots, chunk, store=store, regions=regions)))


def prepare_chunks_relaunch(batch: ResolvedChunkBatch, *, backend: str | None = None):
    """The launch `transfer_chunk_batches([batch])` made, as a function of (the chunks' addresses,
    an int64 array; the slot or block id tensor, or an int64 array of them) that makes it again over other chunks of the same shapes and
    returns True, or launches nothing and returns False for chunks aligned otherwise; None where
    there is no such launch (see `prepare_relaunch`)."""
    if select_backend(batch.group.device, backend) != "triton":
        return None
    from lmcache_ascend.kernels.triton_transfer import prepare_chunks_relaunch as prepare

    return _counted(prepare(batch))


def _counted(relaunch):
    """`relaunch` (None stays None), each launch it makes counted as the launch it repeats was."""
    if relaunch is None:
        return None

    def launch(*addresses) -> bool:
        if not relaunch(*addresses):
            return False
        launch_counter.triton += 1
        return True

    return launch


def transfer_chunk_batches(batches: Sequence[ResolvedChunkBatch], *, backend: str | None = None) -> int:
    """Move layer groups' parts of many chunks (`resolve_chunk_batch`, one batch per group, one
    device): ONE launch for all batches sharing chunks and slots on the Triton backend (one per batch
    counted on torch: `torch_transfer_chunks`). Returns launches."""
    batches = list(batches)
    if not batches:
        return 0
    if select_backend(batches[0].group.device, backend) == "triton":
        from lmcache_ascend.kernels.triton_transfer import triton_transfer_chunk_batches

        launched = triton_transfer_chunk_batches(batches)
        launch_counter.triton += launched
        return launched
    launched = 0
    for batch in batches:
        if batch.num_chunks and batch.rows.max_region_bytes:
            torch_transfer_chunks(batch)
            launched += 1
    launch_counter.torch += launched
    return launched
