"""Environment assumptions the torch adapter relies on (docs/design.md §9)."""

import horovod.torch as hvd
import torch

hvd.init()


def test_alltoall_with_splits_returns_received_splits():
    rank, size = hvd.rank(), hvd.size()
    # Rank r sends (j + 1) rows to rank j, each row holding r.
    splits = torch.tensor([j + 1 for j in range(size)], dtype=torch.int32)
    rows = torch.full((int(splits.sum()), 2), float(rank))
    out, received = hvd.alltoall(rows, splits=splits, name="env.alltoall")
    assert received.tolist() == [rank + 1] * size
    expected = torch.cat([torch.full((rank + 1, 2), float(r)) for r in range(size)])
    assert torch.equal(out, expected)


def test_alltoall_uint8_rows():
    size = hvd.size()
    rows = torch.arange(size * 12, dtype=torch.uint8).view(size, 12)
    out, received = hvd.alltoall(rows, splits=torch.ones(size, dtype=torch.int32), name="env.u8")
    assert out.dtype == torch.uint8 and out.shape == (size, 12)
    assert received.tolist() == [1] * size


def test_allgather_different_length_per_rank():
    rank, size = hvd.rank(), hvd.size()
    mine = torch.full((rank + 1, 3), float(rank))
    out = hvd.allgather(mine, name="env.allgather")
    assert out.shape[0] == size * (size + 1) // 2
    expected = torch.cat([torch.full((r + 1, 3), float(r)) for r in range(size)])
    assert torch.equal(out, expected)


def test_async_handles_complete_out_of_order():
    rank, size = hvd.rank(), hvd.size()
    h1 = hvd.allreduce_async(torch.full((4,), float(rank)), name="env.a1", op=hvd.Sum)
    h2 = hvd.allgather_async(torch.full((1,), float(rank)), name="env.a2")
    h3 = hvd.alltoall_async(torch.arange(size, dtype=torch.float32), name="env.a3")
    gathered = hvd.synchronize(h2)
    summed = hvd.synchronize(h1)
    out, _ = hvd.synchronize(h3)
    assert torch.equal(gathered, torch.arange(size, dtype=torch.float32))
    assert torch.equal(summed, torch.full((4,), float(sum(range(size)))))
    assert torch.equal(out, torch.full((size,), float(rank)))


def test_int32_allreduce_sum():
    out = hvd.allreduce(torch.ones(256, dtype=torch.int32), name="env.int", op=hvd.Sum)
    assert out.dtype == torch.int32 and int(out[0]) == hvd.size()
