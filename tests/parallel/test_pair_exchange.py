"""At P = 2 one all-gather of both selections replaces the reduce-scatter and the
all-gather (common/pair_stages.py): the same parameters, residuals and kept rows bit
for bit as the two collectives. At other world sizes ``gather_selections`` changes
nothing. (One collective a reused step, and no mass lost: the counting tests of
test_joined_exchange_torch.py and test_global_reuse_torch.py, at every size.)"""

import math

import horovod.torch as hvd
import pytest
import torch

import horovod_sparse.torch as hvds
from tests.parallel.test_joined_exchange_torch import flat, model_of

hvd.init()


def train(gather: bool, overlap: bool = False, **options):
    """Train 6 sparse buckets through backward's hooks; the model, the optimizer, and
    each step's kept rows and refreshes."""
    model = model_of(6)
    if overlap:
        options = {**options, "overlap_allgather": True, "model": model}
    opt = hvds.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        model.named_parameters(),
        density=0.01,
        fusion_threshold_bytes=128 * 128 * 4,
        gather_selections=gather,
        **options,
    )
    generator = torch.Generator().manual_seed(hvd.rank())
    kept, refreshes = [], []
    for step in range(14):
        # Inputs that grow for a while, so the reused threshold is capped on some steps.
        x = torch.randn(8, 128, generator=generator) * (1.0 + 0.3 * (step % 5))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        if not overlap:  # with overlap the step's exchange ends at the next forward
            stats = opt.stats()
            kept.append(stats.selected)
            refreshes.append(stats.global_refreshes)
    if overlap:
        opt.flush()
    return model, opt, kept, refreshes


@pytest.mark.parametrize(
    ("overlap", "options"),
    [
        (False, {}),
        (False, {"join_buckets": False}),
        (False, {"partition": "balanced", "repartition_steps": 3}),
        (False, {"global_selection": "exact"}),
        (False, {"compression": hvd.Compression.fp16}),
        (True, {}),
    ],
    ids=["defaults", "apart", "balanced", "exact", "fp16", "overlap"],
)
def test_one_collective_gives_the_two_collectives_results_bitwise(overlap, options):
    (model_a, opt_a, kept_a, refreshes_a), (model_b, opt_b, kept_b, refreshes_b) = (
        train(gather, overlap, **options) for gather in (True, False)
    )
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(a, b)
    residuals_b = opt_b.residuals()
    for name, residual in opt_a.residuals().items():
        assert torch.equal(residual, residuals_b[name]), name
    assert kept_a == kept_b
    assert refreshes_a == refreshes_b
    if not overlap and "global_selection" not in options:
        # Both kinds of step ran: reused ones (capped or not) and refreshes.
        assert 0 < sum(r > 0 for r in refreshes_a) < len(refreshes_a), refreshes_a
    everyone = hvd.allgather(flat(model_a.parameters()).view(1, -1), name="pair.same")
    assert all(torch.equal(row, everyone[0]) for row in everyone)


def test_functional_sparse_allreduce_is_the_same_either_way():
    """``hvds.sparse_allreduce`` of the same tensors under two names, one per setting:
    every call's result and the residuals agree bitwise."""
    generator = torch.Generator().manual_seed(7 + hvd.rank())
    for step in range(10):
        grad = torch.randn(50_000, generator=generator) * (1.0 + step % 3)
        results = [
            hvds.sparse_allreduce(grad, 0.01, name=f"pair.fn.{gather}", gather_selections=gather)
            for gather in (True, False)
        ]
        assert torch.equal(results[0], results[1]), step
    assert torch.equal(hvds.residual("pair.fn.True"), hvds.residual("pair.fn.False"))


def test_the_pair_all_gather_has_one_shape_and_counts_its_padding(monkeypatch):
    """At P = 2 each rank's rows are padded to the most the selection returns
    (floor(1.25 k)), so Horovod's all-gather sees one shape on every step, reused or
    refreshed; the padding never reaches the sums (the results equal the two-collective
    step's bit for bit, and the residual conserves the mass) and its bytes are counted.
    At other world sizes no such all-gather runs, and the rest still holds."""
    pairs = hvd.size() == 2  # elsewhere no all-gather of both selections runs
    numel, density = 40_000, 0.01
    capacity = int(1.25 * math.ceil(density * numel))  # 500 rows
    shapes: list[int] = []
    allgather_async = hvd.allgather_async

    def recording(tensor, *args, **kwargs):
        if kwargs["name"].endswith(".selected"):
            shapes.append(int(tensor.shape[0]))
        return allgather_async(tensor, *args, **kwargs)

    monkeypatch.setattr(hvd, "allgather_async", recording)
    generator = torch.Generator().manual_seed(11 + hvd.rank())
    refreshes = []
    for step in range(10):
        # Growing for a while, then fresh: capped reused steps and refreshes both run.
        grad = torch.randn(numel, generator=generator) * (1.0 + 0.3 * (step % 5))
        before = hvds.residual("pair.padded.True").clone() if step else torch.zeros(numel)
        ours = hvds.sparse_allreduce(grad, density, name="pair.padded.True")
        theirs = hvds.sparse_allreduce(
            grad, density, name="pair.padded.False", gather_selections=False
        )
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=f"step {step}")
        # Mass: summed over both ranks, what each held plus its gradient is what it still
        # holds plus the sum (op=Average: P times the result).
        held = before + grad - hvds.residual("pair.padded.True")
        total = hvd.allreduce(held.sum().reshape(1), op=hvd.Sum)
        torch.testing.assert_close(total, hvd.size() * ours.sum().reshape(1), rtol=1e-4, atol=1e-3)
        stats = hvds.stats("pair.padded.True")
        refreshes.append(stats.global_refreshes)
        if pairs and not stats.global_refreshes:  # a reused step: the all-gather's bytes
            assert stats.bytes_sent == stats.bytes_received == capacity * 8, stats
    if pairs:
        assert len(shapes) == 10 and set(shapes) == {capacity}, shapes
    else:
        assert shapes == [], shapes
    assert 0 < sum(refreshes) < len(refreshes), refreshes
