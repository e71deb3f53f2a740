"""A lone replica's DiLoCo state, built only when a partner appears on its stage.

While a stage has one replica, its outer rounds never run (``AdamWStep`` skips them: nobody to
average with), so no round commits and its outer state is exactly the one it started with: theta =
the stage's starting weights, zero momentum, zero error feedback, the run's initial Q, the
matching lineage. Keeping that state costs ~16 B per trained parameter of shared memory plus an
averager helper process (measured in the demo: ~1.4 GB for the lone tail of 67 M parameters).
Instead it is rebuilt from the starting weights the first time a round finds a partner; the
partner sees the same state it would have downloaded, so training is unchanged.

A replica that starts beside others, or resumes a checkpoint holding outer state, builds it at
once (node.join): those may hold a state that rounds have moved.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch


class DeferredOuter:
    """How to build the stage's ``OuterSync`` later: ``initial`` returns the stage's starting
    trained tensors (by parameter name; runs in the compute thread), ``build`` makes the
    ``OuterSync`` from them (on the main thread: hivemind's averager installs signal handlers)."""

    def __init__(
        self,
        initial: Callable[[], Mapping[str, torch.Tensor]],
        build: Callable[[Mapping[str, torch.Tensor]], object],
    ) -> None:
        self.initial, self.build = initial, build
