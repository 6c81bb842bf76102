"""The steps every LMCache op takes, in one place: each op states only what is its own.

A call of an op looks its repeat up (LMCache makes the same call, shapes and all, chunk after
chunk: see "repeated calls" in `moves`), reads its engine KV format, checks its arguments,
describes the paged caches as one group of planes (once per description of the caches: see
`arguments.TableCache`), moves the rows and keeps the move's repeat for the next call of its
shapes. An `OpCall` subclass per op says how its arguments are checked, cut into planes and
moved; `run` takes each call through the steps in this order, so that a call with several bad
arguments is refused for the first one its op checks.
"""

from __future__ import annotations

import torch

from lmcache_ascend.kernels.paged import PagedGroup
from lmcache_ascend.layouts import FormatFacts
from lmcache_ascend.op_surface.arguments import tables
from lmcache_ascend.op_surface.formats import format_facts
from lmcache_ascend.op_surface.moves import paged_group, repeats, transfer_backend

# One plane of a call's paged caches: its tensor per layer (blocks first), rows per block, bytes per row.
Plane = tuple[list[torch.Tensor], int, int]


class OpCall:
    """One call of one of LMCache's ops: its arguments, and what its checks work out from them.

    A subclass (one per op) names the op and answers each step `run` takes. The repeat's two
    steps read the call's arguments as given (a tuple in the order of the op's signature): the
    call object is made only where no repeat moved the rows, so a repeated call costs no more.
    """

    op = ""  # LMCache's name of the op: every error and key names it
    takes_format = True  # the call names an engine KV format (`engine_kv_format`) the op must take
    # Which argument is the paged caches as LMCache hands them (a pointer table or a list of
    # tensors): repeats and groups are kept per description of it (unread by an op that keeps neither).
    paged_at = 0
    reuses_launch = False  # a call's direct launch may be made again by a later call of its shapes
    # A repeat that refuses a call: whether the launch of that call's whole path takes its place
    # (else the kept one stays, for the calls it fits).
    replaces_refused_repeat = False

    @classmethod
    def repeat_key(cls, backend: str, arguments: tuple) -> tuple | None:
        """The key of the call's repeat (see "repeated calls" in `moves`); None: no repeat fits it."""
        return None

    @staticmethod
    def repeat(kept, arguments: tuple) -> bool:
        """Make `kept`, the launch of an earlier call of these shapes, over this call's buffers."""
        return False

    def check(self, facts: FormatFacts | None) -> tuple[type[OpCall], tuple] | None:
        """Check the arguments (a TransferError names the first wrong one) and keep what the
        other steps need; returns the op (and its arguments) that moves this call's rows instead,
        if another op does."""
        return None

    def planes_key(self) -> tuple | None:
        """What shapes the planes besides the caches themselves; None: the planes are cut every call."""
        return None

    def planes(self) -> list[Plane]:
        """The paged caches cut into planes, checked."""
        raise NotImplementedError

    def move(self, group: PagedGroup, rows: int, backend: str | None, repeatable: bool):
        """Move the call's rows (`rows`: the slots every plane has); where `repeatable`, return the
        move's repeat. `backend`: the one read when the repeat was looked up (None: read it now)."""
        raise NotImplementedError


def run(op: type[OpCall], arguments: tuple) -> None:
    """Take a call of `op` through its steps: repeat, format, checks, planes, move, repeat kept."""
    handle = backend = None
    if op.reuses_launch:
        backend = transfer_backend()
        key = op.repeat_key(backend, arguments)
        if key is not None:
            handle, kept = repeats.lookup(arguments[op.paged_at], key)
            if kept is not None:
                if op.repeat(kept, arguments):
                    return
                if not op.replaces_refused_repeat:
                    handle = None
    call = op(*arguments)
    instead = call.check(format_facts(call.engine_kv_format, op.op) if op.takes_format else None)
    if instead is not None:
        run(*instead)
        return
    group, rows = described_group(call, arguments[op.paged_at])
    repeats.keep(handle, call.move(group, rows, backend, handle is not None))


def described_group(call: OpCall, paged: object) -> tuple[PagedGroup, int]:
    """The group of the call's planes and the slots every plane has: kept per description of the
    caches and `planes_key` where the op has one."""
    key = call.planes_key()
    if key is None:
        return group_of(call.planes())
    return tables.get_or_build(paged, key, lambda: group_of(call.planes()))


def group_of(planes: list[Plane]) -> tuple[PagedGroup, int]:
    group = paged_group(planes)
    return group, min(geometry.num_blocks * plane.block_size
                      for per_layer in group.geometry for geometry, plane in zip(per_layer, group.planes))
