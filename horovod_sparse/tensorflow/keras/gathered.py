"""A Keras checkpoint that one rank saves and every rank restores exactly.

The optimizer's sparse state is optimizer variables, so ``model.save`` and Keras's
``ModelCheckpoint`` carry it; but each rank's residuals, velocities or moments and
local thresholds are its own, and a file written by rank 0 alone (Horovod's pattern:
the checkpoint callback on rank 0 only) holds rank 0's. :class:`GatheredState` brings
every rank's sparse-state variables to rank 0 for a file of their own, and gives each
rank its own back after the model is loaded.

Sends, per ``state_dict()``: one pickled allgather of each rank's sparse-state variables
(about the sparse buckets' size, on the host) within the optimizer's process set. It is
a collective: every rank calls it. Keeps nothing.
"""

from __future__ import annotations

from typing import Any

import horovod.tensorflow as hvd
import numpy as np

__all__ = ["GatheredState"]


class GatheredState:
    """``optimizer``'s sparse state (a built ``DistributedOptimizer``) as a dict any one
    rank may save, e.g. with ``pickle`` next to the ``.keras`` file.

    ``state_dict()`` (every rank calls it): on the process set's first rank,
    ``{"world_size": P, "parts": {rank: {name: array}}}`` of every rank's
    ``optimizer.state_variables()``; on the others, their own part only.
    ``load_state_dict(saved)``: assigns this rank's part; a state gathered at another
    world size is refused (the variables of one rank do not fit another partition).
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def _process_set(self) -> Any:
        return self.optimizer._sparse_options["process_set"]

    def state_dict(self) -> dict[str, Any]:
        process_set = self._process_set()
        own = {name: v.numpy() for name, v in self.optimizer.state_variables().items()}
        everyone = hvd.allgather_object(
            own, name="hvds.keras.gathered_state", process_set=process_set
        )
        rank = process_set.rank()
        parts = dict(enumerate(everyone)) if rank == 0 else {rank: own}
        return {"world_size": process_set.size(), "parts": parts}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        process_set = self._process_set()
        rank, size = process_set.rank(), process_set.size()
        if int(saved["world_size"]) != size or rank not in saved["parts"]:
            raise ValueError(
                f"this state was gathered from {saved['world_size']} ranks and holds ranks "
                f"{sorted(saved['parts'])}; rank {rank} of {size} cannot take its part"
            )
        variables = self.optimizer.state_variables()
        mine = saved["parts"][rank]
        if set(mine) != set(variables):
            raise ValueError(
                "the saved sparse state names other variables than this optimizer's: "
                f"{sorted(set(mine) ^ set(variables))}"
            )
        for name, variable in variables.items():
            variable.assign(np.asarray(mine[name]))
