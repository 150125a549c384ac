"""The plugin's CPU thread count (horovod_sparse/torch/threads.py): lowered to the
cores per local rank while its kernels run, restored after, never raised."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from horovod_sparse.torch import threads as threads_module  # noqa: E402
from horovod_sparse.torch.threads import LocalThreads, local_ranks_from_environment  # noqa: E402


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_scope_lowers_to_cores_per_local_rank_and_restores(monkeypatch, two_threads):
    monkeypatch.setattr(threads_module, "cores_available", lambda: 2)
    budget = LocalThreads(lambda: 2)
    assert budget.threads == 1
    with budget.scope():
        assert torch.get_num_threads() == 1
        with budget.scope():  # nested: stays lowered, restores nothing early
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2


def test_scope_never_raises_a_lower_setting(monkeypatch, two_threads):
    monkeypatch.setattr(threads_module, "cores_available", lambda: 16)
    budget = LocalThreads(lambda: 1)
    assert budget.threads == 16
    with budget.scope():
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 2


def test_scope_restores_after_an_error(monkeypatch, two_threads):
    monkeypatch.setattr(threads_module, "cores_available", lambda: 4)
    budget = LocalThreads(lambda: 4)
    with pytest.raises(RuntimeError), budget.scope():
        assert torch.get_num_threads() == 1
        raise RuntimeError("a kernel failed")
    assert torch.get_num_threads() == 2


def test_local_ranks_from_the_launchers_environment(monkeypatch):
    for variable in ("LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    assert local_ranks_from_environment() == 1
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "3")
    assert local_ranks_from_environment() == 3
    monkeypatch.setenv("HOROVOD_LOCAL_SIZE", "5")  # horovodrun's, before Open MPI's
    assert local_ranks_from_environment() == 5
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's, read first
    assert local_ranks_from_environment() == 4


def test_every_selection_and_owner_kernel_of_a_step_runs_at_the_lowered_count(
    monkeypatch, two_threads
):
    """An engine step (two sparse buckets, one dense): the kernels of the selection,
    the owner reduction and the result run at 1 thread; the caller's 2 come back."""
    import numpy as np

    from horovod_sparse.common.config import SparseConfig
    from horovod_sparse.torch.kernels import TorchKernels
    from tests.unit.test_engine import make_engine, run_step

    seen: dict[str, list[int]] = {}
    for name in ("topk_indices", "indices_at_least", "unique_inverse", "scatter_into"):
        real = getattr(TorchKernels, name)

        def spy(self, *args, _real=real, _name=name, **kwargs):
            seen.setdefault(_name, []).append(torch.get_num_threads())
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(TorchKernels, name, spy)
    monkeypatch.setattr(threads_module, "cores_available", lambda: 2)
    engine, ops, to, _ = make_engine(SparseConfig(density=0.05, selection="threshold"))
    monkeypatch.setattr(type(ops), "local_threads", LocalThreads(lambda: 2))
    rng = np.random.default_rng(0)
    for _ in range(2):
        run_step(engine, ops, to, rng)
        assert torch.get_num_threads() == 2
    assert set(seen) >= {"indices_at_least", "unique_inverse", "scatter_into"}
    assert all(count == 1 for counts in seen.values() for count in counts), seen


def test_a_rank_sharing_cores_sleeps_between_polls_and_one_with_cores_leaves_it_to_horovod(
    monkeypatch,
):
    """Horovod's synchronize spins; a rank with at most one core of its own polls
    instead, sleeping 20 us, doubling to at most 100 us (500 us where the host has more
    ranks than cores), and synchronizes once done."""
    pytest.importorskip("horovod.torch")
    from horovod_sparse.torch import backend as backend_module

    polls, sleeps, synchronized = [], [], []

    def poll(handle):
        polls.append(handle)
        return len(polls) > 8  # done at the ninth poll

    monkeypatch.setattr(backend_module.hvd, "poll", poll)
    monkeypatch.setattr(backend_module.hvd, "synchronize", lambda h: synchronized.append(h) or h)
    monkeypatch.setattr(backend_module.time, "sleep", sleeps.append)
    pending = backend_module._Pending(7, "plain")
    shared, own = backend_module.TorchBackend(), backend_module.TorchBackend()
    shared.local_threads = LocalThreads(lambda: 4)
    monkeypatch.setattr(threads_module, "cores_available", lambda: 2)
    assert shared.local_threads.threads == 1
    assert shared.wait(pending) == 7
    assert polls == [7] * 9 and synchronized == [7]
    assert sleeps == pytest.approx([20e-6, 40e-6, 80e-6, 160e-6, 320e-6, 500e-6, 500e-6, 500e-6])
    polls.clear(), sleeps.clear(), synchronized.clear()
    fits = backend_module.TorchBackend()
    fits.local_threads = LocalThreads(lambda: 2)  # a core each
    assert fits.local_threads.threads == 1 and not fits.local_threads.oversubscribed
    assert fits.wait(pending) == 7
    assert polls == [7] * 9 and synchronized == [7]
    assert sleeps == pytest.approx([20e-6, 40e-6, 80e-6] + [100e-6] * 5)
    polls.clear(), sleeps.clear(), synchronized.clear()
    own.local_threads = LocalThreads(lambda: 1)
    monkeypatch.setattr(threads_module, "cores_available", lambda: 8)
    assert own.wait(pending) == 7
    assert polls == [] and sleeps == [] and synchronized == [7]


def test_an_oversubscribed_host_is_warned_once(monkeypatch):
    monkeypatch.setattr(threads_module, "_WARNED", False)
    with pytest.warns(RuntimeWarning, match=r"2 ranks on this host each run torch at 2 "):
        threads_module.warn_if_oversubscribed(threads=2, local_ranks=2, cores=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        threads_module.warn_if_oversubscribed(threads=2, local_ranks=2, cores=2)  # once


@pytest.mark.parametrize(
    ("threads", "local_ranks", "cores"),
    [(1, 2, 2), (2, 1, 2), (4, 1, 2), (8, 2, 16), (1, 16, 8)],
)
def test_a_host_whose_threads_fit_its_cores_is_not_warned(monkeypatch, threads, local_ranks, cores):
    monkeypatch.setattr(threads_module, "_WARNED", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        threads_module.warn_if_oversubscribed(threads, local_ranks, cores)


def test_the_first_use_of_the_thread_count_checks_the_host(monkeypatch, two_threads):
    monkeypatch.setattr(threads_module, "_WARNED", False)
    monkeypatch.setattr(threads_module, "cores_available", lambda: 2)
    with pytest.warns(RuntimeWarning, match="torch.set_num_threads\\(1\\)"):
        assert LocalThreads(lambda: 2).threads == 1
