"""The DDP hook at P = 2 in one collective a bucket (common/pair_stages.py): the
parameters and residuals of the reduce-scatter and the all-gather bit for bit, without
the alltoall. At other world sizes ``gather_selections`` changes nothing. Under torchrun
at 2, 3 and 4 ranks."""

import pytest
import torch

from horovod_sparse.torch import distributed
from horovod_sparse.torch.ddp import SparseState
from tests.parallel.test_ddp import SIZE, flat_parameters, make_run, train


@pytest.mark.parametrize(
    "options",
    [{"momentum": 0.9}, {"fp16_values": True}, {"partition": "balanced", "repartition_steps": 2}],
    ids=["momentum", "fp16", "balanced"],
)
def test_one_collective_gives_the_two_collectives_results_bitwise(options, monkeypatch):
    alltoalls = []
    real = distributed.BACKEND.alltoall_async

    def counting(*args, **kwargs):
        alltoalls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(distributed.BACKEND, "alltoall_async", counting)
    runs = {}
    for gather in (True, False):
        state = SparseState(
            density=0.05, min_sparse_numel=5000, gather_selections=gather, **options
        )
        model, optimizer = make_run(state)
        before = len(alltoalls)
        train(model, optimizer, range(12))
        runs[gather] = (state, model, len(alltoalls) - before)
    (state_a, model_a, scatters_a), (state_b, model_b, scatters_b) = runs[True], runs[False]
    assert torch.equal(flat_parameters(model_a), flat_parameters(model_b))
    assert state_a.reducers.keys() == state_b.reducers.keys() and state_a.reducers
    for key, reducer in state_a.reducers.items():
        assert torch.equal(reducer.residual, state_b.reducers[key].residual), key
    assert scatters_b > 0
    assert scatters_a == (0 if SIZE == 2 else scatters_b)
