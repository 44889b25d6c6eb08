"""A reader distrusts every descriptor: ``validate`` / ``read_tensor`` reject each way one can be wrong.

The reference case is one float32 tensor of shape (3, 8, 8) in frontend 0's partition. Each
test bends one field of its descriptor and expects the matching DescriptorError subclass;
nothing is read and nothing is returned for a bad descriptor. Error messages reach clients
(as a failed request), so none of them may name an IPC object or the instance id.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import numpy as np
import pytest

from shmgate.shared.arena import BLOCK_HEADER_BYTES, Allocation, Partition, read_tensor, recheck, validate, view_tensor
from shmgate.shared.errors import (
    ChannelFull,
    DescriptorError,
    InconsistentTensor,
    OutOfBounds,
    SetupError,
    ShmgateError,
    StaleGeneration,
)
from shmgate.shared.instance import Instance
from shmgate.shared.segment import SlotState
from shmgate.shared.wire import Submit, TensorRef, encoder, worker_decoder
from tests.shm_children import leftovers

PARTITION = 1 << 20
SHAPE = (3, 8, 8)
NBYTES = 3 * 8 * 8 * 4
MAX = 2**63 - 1


@dataclass
class Arena:
    inst: Instance
    partition: Partition
    good: TensorRef
    data: np.ndarray

    @property
    def seg(self):  # type: ignore[no-untyped-def]
        return self.inst.segment

    def bent(self, **changes: object) -> TensorRef:
        fields = {f: getattr(self.good, f) for f in TensorRef.__struct_fields__}
        fields.update(changes)
        return TensorRef(**fields)  # type: ignore[arg-type]


@pytest.fixture()
def arena() -> Iterator[Arena]:
    inst = Instance.create(arena_size=2 * PARTITION, n_frontends=2, n_workers=1, queue_depth=1)
    try:
        seg = inst.segment
        seg.claim_slot(seg.frontends, 0)
        seg.frontends[0]["state"] = SlotState.READY
        partition = Partition(seg, 0)
        partition.allocate(1000)  # so the reference tensor does not sit at the partition start
        allocation = partition.allocate(NBYTES)
        assert allocation is not None
        data = np.arange(NBYTES // 4, dtype=np.float32).reshape(SHAPE)
        partition.array(allocation, "float32", SHAPE)[:] = data
        good = TensorRef(
            offset=allocation.offset,
            nbytes=NBYTES,
            generation=allocation.generation,
            dtype="float32",
            shape=SHAPE,
            name="pixels",
        )
        yield Arena(inst, partition, good, data)
    finally:
        instance_id = inst.names.instance_id
        inst.unlink()
        inst.close()
        assert leftovers(instance_id) == []


def rejects(arena: Arena, ref: TensorRef, error: type[DescriptorError]) -> DescriptorError:
    with pytest.raises(error) as caught:
        validate(arena.seg, ref)
    with pytest.raises(error):
        read_tensor(arena.seg, ref)
    with pytest.raises(error):
        view_tensor(arena.seg, ref)
    assert_no_ipc_names(arena, caught.value)
    return caught.value


def assert_no_ipc_names(arena: Arena, error: BaseException) -> None:
    for text in (str(error), repr(error)):
        assert "/shmgate." not in text and "shmgate." not in text
        assert arena.inst.names.instance_id not in text


# -- the good descriptor -------------------------------------------------------------------------


def test_a_good_descriptor_reads_back_its_tensor(arena: Arena) -> None:
    validate(arena.seg, arena.good)
    out = read_tensor(arena.seg, arena.good)
    assert np.array_equal(out.view(np.float32).reshape(SHAPE), arena.data)
    view = view_tensor(arena.seg, arena.good)
    assert view.dtype == np.float32 and view.shape == SHAPE and not view.flags.writeable
    assert np.array_equal(view, arena.data)
    recheck(arena.seg, arena.good)


def test_a_descriptor_survives_the_wire_and_still_validates(arena: Arena) -> None:
    message = worker_decoder.decode(
        encoder.encode(Submit(request_id=1, reply_slot=0, model="m", tensors=(arena.good,)))
    )
    assert message.tensors == (arena.good,)
    validate(arena.seg, message.tensors[0])


# -- bounds ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["end", "past_end", "far", "max"])
def test_offset_beyond_the_arena_is_out_of_bounds(arena: Arena, where: str) -> None:
    total = arena.seg.layout.total_size
    offset = {"end": total, "past_end": total + 64, "far": 1 << 40, "max": MAX}[where]
    rejects(arena, arena.bent(offset=offset), OutOfBounds)


@pytest.mark.parametrize(("offset", "nbytes"), [("good", MAX), (MAX, MAX), (MAX - 63, 64), ("good", 2**64 - 1)])
def test_offset_plus_size_that_overflows_is_out_of_bounds(arena: Arena, offset: object, nbytes: int) -> None:
    start = arena.good.offset if offset == "good" else offset
    rejects(arena, arena.bent(offset=start, nbytes=nbytes, dtype="uint8", shape=(nbytes,)), OutOfBounds)


def test_overflowing_values_from_the_wire_are_out_of_bounds(arena: Arena) -> None:
    """msgpack carries them fine (they are non-negative); validate must still refuse them."""
    ref = arena.bent(offset=MAX, nbytes=MAX, generation=MAX, dtype="uint8", shape=(MAX,))
    decoded = worker_decoder.decode(encoder.encode(Submit(request_id=1, reply_slot=0, model="m", tensors=(ref,))))
    rejects(arena, decoded.tensors[0], OutOfBounds)


def test_negative_values_never_decode_from_the_wire(arena: Arena) -> None:
    ref = arena.bent(offset=-64)
    with pytest.raises(msgspec.ValidationError):
        worker_decoder.decode(encoder.encode(Submit(request_id=1, reply_slot=0, model="m", tensors=(ref,))))
    rejects(arena, ref, OutOfBounds)  # and validate refuses them built by hand


@pytest.mark.parametrize("offset", [0, 64, 512, 1024, "index", "data_start", "header_of_first_block"])
def test_offset_inside_the_header_regions_is_out_of_bounds(arena: Arena, offset: object) -> None:
    layout = arena.seg.layout
    value = {
        "index": layout.index_offset + 64,
        "data_start": layout.data_offset,
        "header_of_first_block": layout.data_offset + 32,
    }.get(offset, offset)  # type: ignore[call-overload]
    rejects(arena, arena.bent(offset=value, nbytes=64, dtype="uint8", shape=(64,)), OutOfBounds)


@pytest.mark.parametrize("shift", [1, 4, 8, 32, 63, -1])
def test_misaligned_offset_is_out_of_bounds(arena: Arena, shift: int) -> None:
    rejects(arena, arena.bent(offset=arena.good.offset + shift), OutOfBounds)


def test_tensor_crossing_into_the_next_partition_is_out_of_bounds(arena: Arena) -> None:
    _, end = arena.seg.partition_bounds(0)
    nbytes = end - arena.good.offset + 64
    error = rejects(arena, arena.bent(nbytes=nbytes, dtype="uint8", shape=(nbytes,)), OutOfBounds)
    assert "partition" in str(error)


def test_tensor_running_past_the_arena_end_is_out_of_bounds(arena: Arena) -> None:
    nbytes = arena.seg.layout.total_size - arena.good.offset + 1
    rejects(arena, arena.bent(nbytes=nbytes, dtype="uint8", shape=(nbytes,)), OutOfBounds)


def test_descriptor_claiming_more_than_its_allocation_holds_is_out_of_bounds(arena: Arena) -> None:
    rejects(arena, arena.bent(nbytes=NBYTES * 4, shape=(3, 8, 32)), OutOfBounds)


# -- dtype and shape ---------------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [NBYTES - 4, NBYTES - 1, NBYTES + 4, 0])
def test_dtype_times_shape_not_equal_to_nbytes_is_inconsistent(arena: Arena, nbytes: int) -> None:
    rejects(arena, arena.bent(nbytes=nbytes), InconsistentTensor)


@pytest.mark.parametrize("shape", [(3, 8, 4), (6, 8, 8), (768,), ()])
def test_shape_that_does_not_fit_the_dtype_is_inconsistent(arena: Arena, shape: tuple[int, ...]) -> None:
    rejects(arena, arena.bent(shape=shape), InconsistentTensor)


@pytest.mark.parametrize("dtype", ["complex128", "float8", "", "object", "float32 ", "x" * 200])
def test_unknown_dtype_is_inconsistent(arena: Arena, dtype: str) -> None:
    error = rejects(arena, arena.bent(dtype=dtype), InconsistentTensor)
    assert len(str(error)) < 100, "the message echoes an unbounded client-controlled string"


@pytest.mark.parametrize(
    "shape",
    [(-1, 8, 8), (3, -8, -8), (2**62, 2**62, 1), (MAX, 1, 1), (1,) * 9, (0, 2**63), (0, 2**40, 2**40)],
)
def test_negative_huge_or_too_many_dims_are_inconsistent(arena: Arena, shape: tuple[int, ...]) -> None:
    nbytes = 0 if 0 in shape else NBYTES
    rejects(arena, arena.bent(shape=shape, nbytes=nbytes), InconsistentTensor)


# -- generations -------------------------------------------------------------------------------------


def test_freed_allocation_is_stale(arena: Arena) -> None:
    allocation = allocation_of(arena.good)
    arena.partition.free(allocation)
    rejects(arena, arena.good, StaleGeneration)


def test_reused_allocation_is_stale_for_the_old_descriptor(arena: Arena) -> None:
    old = allocation_of(arena.good)
    arena.partition.free(old)
    new = arena.partition.allocate(NBYTES)
    assert new is not None and new.offset == old.offset and new.generation != old.generation
    arena.partition.array(new, "float32", SHAPE)[:] = -1.0
    rejects(arena, arena.good, StaleGeneration)
    fresh = arena.bent(generation=new.generation)
    assert np.all(view_tensor(arena.seg, fresh) == -1.0)


@pytest.mark.parametrize("delta", [1, -1, 1 << 20])
def test_wrong_generation_is_stale(arena: Arena, delta: int) -> None:
    rejects(arena, arena.bent(generation=arena.good.generation + delta), StaleGeneration)


def test_generation_zero_is_stale(arena: Arena) -> None:
    rejects(arena, arena.bent(generation=0), StaleGeneration)


def test_offset_into_the_middle_of_a_tensor_is_refused(arena: Arena) -> None:
    """Aligned, in bounds, consistent, but not where an allocation starts: its 'header' is data."""
    big = arena.partition.allocate(4096)
    assert big is not None
    arena.partition.array(big, "uint8", (4096,))[:] = 0x11
    ref = TensorRef(offset=big.offset + 1024, nbytes=64, generation=big.generation, dtype="uint8", shape=(64,))
    rejects(arena, ref, StaleGeneration)


def test_free_between_view_and_recheck_is_caught_by_recheck(arena: Arena) -> None:
    view = view_tensor(arena.seg, arena.good)
    arena.partition.free(allocation_of(arena.good))
    with pytest.raises(StaleGeneration):
        recheck(arena.seg, arena.good)
    del view


def allocation_of(ref: TensorRef) -> Allocation:
    """The owner's handle of the block a (good) descriptor points at."""
    return Allocation(ref.offset - BLOCK_HEADER_BYTES, ref.offset, ref.nbytes, ref.generation)


# -- messages never name IPC objects --------------------------------------------------------------------


def test_error_messages_never_name_ipc_objects_or_the_instance(arena: Arena) -> None:
    errors: list[ShmgateError] = []
    inst = arena.inst
    for ref in (
        arena.bent(offset=MAX),
        arena.bent(offset=arena.good.offset + 8),
        arena.bent(dtype="float8"),
        arena.bent(generation=0),
        arena.bent(nbytes=NBYTES * 4, shape=(3, 8, 32)),
    ):
        with pytest.raises(DescriptorError) as caught:
            read_tensor(arena.seg, ref)
        errors.append(caught.value)
    with pytest.raises(SetupError) as missing:
        Instance.attach("0123456789abcdef")
    errors.append(missing.value)
    queue = inst.request_queue()  # depth 1 in this fixture
    queue.send(Submit(1, 0, "m"), 1.0)
    with pytest.raises(ChannelFull) as full:
        queue.send(Submit(2, 0, "m"), 0.05)
    errors.append(full.value)
    queue.close()
    for error in errors:
        assert_no_ipc_names(arena, error)
        if error.__cause__ is not None:  # posix_ipc's own text may name the object; it stays internal
            assert str(error) != str(error.__cause__)
