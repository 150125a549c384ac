"""The DDP hook state's checkpoint half: ``state_dict``, ``load_state_dict``, pickling,
and the residual policy's agreement after a load (docs/design.md §6).

Sends: one ``all_gather_object`` of who saved the loaded residuals, at the first sparse
step after the state was made or loaded. Keeps nothing of its own.
"""

# No ``from __future__ import annotations``, as in ddp.py.
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from horovod_sparse.common.engine_state import residual_share_among
from horovod_sparse.torch.ddp_correction import HookCorrection

if TYPE_CHECKING:
    from horovod_sparse.common.config import SparseConfig
    from horovod_sparse.common.engine import Engine
    from horovod_sparse.common.pipeline import BucketReducer
    from horovod_sparse.common.stats import StepStats
    from horovod_sparse.torch.ddp_layout import BucketLayout

__all__ = ["StateSaving"]


class StateSaving:
    """What :class:`~horovod_sparse.torch.ddp.SparseState` saves and restores."""

    if TYPE_CHECKING:  # SparseState's
        config: SparseConfig
        process_group: Any
        fp16_values: bool
        iteration: int
        reducers: dict[int, BucketReducer]
        correction: HookCorrection
        layout: BucketLayout
        _saved: dict[int, dict[str, Any]]
        _engines: dict[int, Engine]
        _last: dict[int, StepStats | None]
        _saver: dict[str, Any] | None
        _share: float | None
        _owner_token: str

        def _begin(
            self, config: SparseConfig, group: Any, correction: HookCorrection, fp16: bool
        ) -> None: ...

    def _residual_share(self) -> float:
        """The share of its loaded residuals this rank takes (docs/design.md §6,
        ``residual_share_among``): every rank says whose residuals it loaded, in one
        ``all_gather_object`` at the first sparse step after the state was made or
        loaded (every rank runs it there, loaded or not), so that a checkpoint saved by
        one rank and loaded by all (as Accelerate and Lightning save) counts its mass
        once, and per-rank checkpoints restore exactly."""
        if self._share is None:
            saver = self._saver
            mine = None if saver is None else (int(saver["rank"]), str(saver["owner"]))
            everyone: list[Any] = [None] * dist.get_world_size(self.process_group)
            dist.all_gather_object(everyone, mine, group=self.process_group)
            self._share = residual_share_among(mine, everyone)
        return self._share

    def state_dict(self) -> dict[str, Any]:
        """Residuals, steps, layout and velocities (references, as torch optimizers'
        state), and who saved them (rank, world size, this process), so that a
        checkpoint saved by one rank and loaded by all counts its residual once."""
        buckets = {index: r.state_dict() for index, r in self.reducers.items()}
        initialized = dist.is_available() and dist.is_initialized()
        return {
            "rank": dist.get_rank(self.process_group) if initialized else 0,
            "world_size": dist.get_world_size(self.process_group) if initialized else 1,
            "owner": self._owner_token,
            "iteration": self.iteration,
            "buckets": {**self._saved, **buckets},
            **self.layout.state_dict(),
            **self.correction.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; each bucket's residual is taken at its next step
        by the residual policy of docs/design.md §6 (a warning when this rank loads
        another rank's residuals)."""
        self.iteration = int(state["iteration"])
        self._saver = (
            {k: state[k] for k in ("rank", "world_size", "owner")} if "owner" in state else None
        )
        self.reducers, self._engines, self._share = {}, {}, None
        self._saved = {int(i): s for i, s in state["buckets"].items()}
        self.layout.load_state_dict(state)  # the next call is a new DDP instance's first
        self.correction.load_state_dict(state)
        self._last = {}

    def __getstate__(self) -> dict[str, Any]:
        # A process group does not pickle: the unpickled state reduces over the default
        # group unless one is set (as PowerSGDState does).
        correction = self.correction
        return {
            "config": self.config,
            "momentum": correction.momentum,
            "nesterov": correction.nesterov,
            "betas": correction.betas,
            "eps": correction.eps,
            "fp16_values": self.fp16_values,
            "saved": self.state_dict(),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        names = {"momentum": 0.0, "nesterov": False, "betas": None, "eps": 1e-8}
        correction = HookCorrection.checked(*(state.get(name, d) for name, d in names.items()))
        self._begin(state["config"], None, correction, state.get("fp16_values", False))
        self.load_state_dict(state["saved"])
