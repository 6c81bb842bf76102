"""`lmcache_ascend.ops` refuses paged tensors whose rows are not key_value's rows, as LMCache's baseline does.

A paged tensor handed as a tensor (the list form of `multi_layer_kv_transfer` and its
unilateral form, `single_layer_kv_transfer`, the flash ops) is cut into rows of the
LMCache-side buffer's hidden size (its last dim). With another width, twice or half the
paged one, or with heads split off the row, LMCache 0.5.6's torch baseline raises a
shape mismatch; ours must raise too, naming the argument, before a byte moves: every
tensor is poisoned first and compared element for element afterwards. The slots are
few and small, so no other check (the slot range) could be what refuses.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lmcache.v1.platform.torch_ops", reason="LMCache 0.5.x's torch baseline")

NB, BS, NH, HS, LAYERS, TOKENS = 8, 4, 2, 4, 2, 3
HIDDEN = NH * HS
SLOTS = (0, 5, 2)
H2D, D2H = 0, 1


def _poisoned(shape, fill):
    return torch.full(shape, fill, dtype=torch.float16)


def _multi_layer_cases():
    """(name, format, key_value shape, paged layer shape): every paged layer shape the baseline refuses."""
    pages = NB * BS
    for fmt, kv_planes, shapes in (
        (1, 2, {"hidden*2": (2, pages, 2 * HIDDEN), "hidden/2": (2, pages, HIDDEN // 2),
                "heads split": (2, pages, NH, HS)}),
        (2, 2, {"hidden*2": (NB, 2, BS, 2 * HIDDEN), "hidden/2": (NB, 2, BS, HIDDEN // 2),
                "heads split": (NB, 2, BS, NH, HS)}),
        (3, 1, {"hidden*2": (pages, 2 * HIDDEN), "hidden/2": (pages, HIDDEN // 2), "blocks kept": (NB, BS, HIDDEN)}),
        (5, 1, {"hidden*2": (pages, 2 * HIDDEN), "one-head axis": (pages, 1, HIDDEN)}),
    ):
        for name, shape in shapes.items():
            yield f"fmt{fmt}-{name}", fmt, (kv_planes, LAYERS, TOKENS, HIDDEN), shape


def _run(ops, call, tensors, baseline):
    """Run `call` on clones of `tensors`; (the exception or None, the clones afterwards)."""
    world = [t.clone() for t in tensors]
    try:
        call(ops, world, baseline)
    except Exception as error:  # noqa: BLE001 - compared by the caller
        return error, world
    return None, world


def _assert_refused_untouched(call, tensors, names):
    from lmcache_ascend.kernels.spec import TransferError
    from tests.ops._baseline import lmcache_baseline, ours

    baseline = lmcache_baseline()
    theirs, _ = _run(baseline, call, tensors, True)
    assert theirs is not None, "the baseline moved: this case is no mismatch"
    mine, world = _run(ours(baseline.fmt), call, tensors, False)
    assert isinstance(mine, TransferError), f"ours did not refuse (baseline: {theirs!r}); got {mine!r}"
    message = str(mine)
    assert any(name in message for name in names) and "hidden size" in message and "has shape" in message, message
    for index, (before, after) in enumerate(zip(tensors, world)):
        assert torch.equal(before.view(torch.int16) if before.is_floating_point() else before,
                           after.view(torch.int16) if after.is_floating_point() else after), f"tensor {index} changed"


@pytest.mark.parametrize("direction", (H2D, D2H), ids=("load", "store"))
@pytest.mark.parametrize("name, fmt, kv_shape, paged_shape", list(_multi_layer_cases()),
                         ids=[case[0] for case in _multi_layer_cases()])
def test_multi_layer_refuses_listed_layers_of_another_row_width(name, fmt, kv_shape, paged_shape, direction):
    kv = _poisoned(kv_shape, 3.0 if direction == H2D else -7.0)
    paged = [_poisoned(paged_shape, -7.0 if direction == H2D else 3.0) for _ in range(LAYERS)]
    slots = torch.tensor(SLOTS, dtype=torch.int64)

    def call(ops, world, baseline):
        kv_, slots_, *paged_ = world
        ops.multi_layer_kv_transfer(kv_, paged_, slots_, torch.device("cpu"), NB * BS, direction, ops.fmt(fmt),
                                    block_size=BS, head_size=HS)

    _assert_refused_untouched(call, [kv, slots, *paged], ("key_value_ptrs[0]",))


@pytest.mark.parametrize("direction", (H2D, D2H), ids=("load", "store"))
@pytest.mark.parametrize("fmt", (4, 9))
@pytest.mark.parametrize("paged_shape", ((NB * BS, 2 * HIDDEN), (NB * BS, HIDDEN // 2), (NB * BS, NH, HS)),
                         ids=("hidden*2", "hidden/2", "heads split"))
def test_unilateral_refuses_listed_buffers_of_another_row_width(paged_shape, fmt, direction):
    kv = _poisoned((2, LAYERS, TOKENS, HIDDEN), 3.0 if direction == H2D else -7.0)
    paged = [_poisoned(paged_shape, -7.0 if direction == H2D else 3.0) for _ in range(2 * LAYERS)]
    slots = torch.tensor(SLOTS, dtype=torch.int64)

    def call(ops, world, baseline):
        kv_, slots_, *paged_ = world
        ops.multi_layer_kv_transfer_unilateral(kv_, paged_, slots_, torch.device("cpu"), NB * BS, direction,
                                               ops.fmt(fmt))

    _assert_refused_untouched(call, [kv, slots, *paged], ("key_value_ptrs[0]",))


@pytest.mark.parametrize("direction", (H2D, D2H), ids=("load", "store"))
@pytest.mark.parametrize("fmt, lmc_shape, paged_shape", (
    (1, (TOKENS, 2, 2 * HIDDEN), (2, NB, BS, NH, HS)),
    (1, (TOKENS, 2, HIDDEN // 2), (2, NB, BS, NH, HS)),
    (2, (TOKENS, 2, HIDDEN // 2), (NB, 2, BS, NH, HS)),
    (3, (TOKENS, HS // 2), (NB, BS, HS)),
    (3, (TOKENS, 2 * HS), (NB, BS, HS)),
), ids=("fmt1-hidden*2", "fmt1-hidden/2", "fmt2-hidden/2", "mla-hidden/2", "mla-hidden*2"))
def test_single_layer_refuses_a_paged_layer_of_another_row_width(fmt, lmc_shape, paged_shape, direction):
    lmc = _poisoned(lmc_shape, 3.0 if direction == H2D else -7.0)
    paged = _poisoned(paged_shape, -7.0 if direction == H2D else 3.0)
    slots = torch.tensor(SLOTS, dtype=torch.int64)

    def call(ops, world, baseline):
        lmc_, paged_, slots_ = world
        ops.single_layer_kv_transfer(lmc_, paged_, slots_, direction, ops.fmt(fmt), True)

    _assert_refused_untouched(call, [lmc, paged, slots], ("vllm_key_value_cache",))


@pytest.mark.parametrize("op", ("load_and_reshape_flash", "reshape_and_cache_back_flash"))
@pytest.mark.parametrize("hidden", (2 * HIDDEN, HIDDEN // 2), ids=("hidden*2", "hidden/2"))
def test_flash_ops_refuse_caches_of_another_row_width(op, hidden):
    gather = op == "load_and_reshape_flash"
    kv = _poisoned((2, LAYERS, TOKENS, hidden), -7.0 if gather else 3.0)
    caches = [_poisoned((NB, BS, NH, HS), 3.0 if gather else -7.0) for _ in range(2)]
    slots = torch.tensor(SLOTS, dtype=torch.int64)

    def call(ops, world, baseline):
        kv_, key_, value_, slots_ = world
        getattr(ops, op)(kv_, key_, value_, slots_, 1)

    _assert_refused_untouched(call, [kv, *caches, slots], ("key_cache",))
