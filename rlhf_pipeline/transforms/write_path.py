"""The thin torchrl ``Transform`` shell shared by the write-path transforms (:class:`WritePathTransform`).
Attached with ``rb.append_transform(t, invert=True)``, torchrl 0.14 calls ``t._call`` on ``rb.extend``
(through ``_InvertTransform._inv_call``) and ``t.inv`` on ``rb.sample``: ``_call`` and ``forward`` run
:meth:`~WritePathTransform.write`, ``inv`` passes sampled data through, and ``_inv_call`` (reached only
when attached without ``invert=True``) raises saying how to attach. ``None`` (no group complete yet)
passes down the chain and stores nothing. State goes through ``get_extra_state`` / ``set_extra_state``,
the only way ``nn.Module.state_dict`` reaches a transform inside the buffer's ``Compose``; payloads hold
tensors, numbers, strings and lists only, so ``torch.load(weights_only=True)`` reads them.
Design: docs/write-path.md#how-the-transforms-sit-in-torchrl.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchrl.envs.transforms import Transform

from rlhf_pipeline.schema import TrajectoryBatch


class WritePathTransform(Transform):
    """Base of the write-path transforms: subclasses implement :meth:`write`."""

    fills_fields: tuple[str, ...] = ()
    """The stored fields this transform computes; ``import`` skips a transform when the source
    already carries all of them (rows keep the values they were exported with)."""

    def write(self, batch: TrajectoryBatch | None) -> TrajectoryBatch | None:
        raise NotImplementedError

    # ---- torchrl entry points (see the module docstring for who calls which)
    def _call(self, data):
        return self.write(data)

    def forward(self, data):
        return self.write(data)

    def inv(self, data):
        return data

    def _inv_call(self, data):
        raise RuntimeError(
            f"{type(self).__name__} is a write-path transform: attach it with "
            f"rb.append_transform(transform, invert=True), not as a plain (read-path) transform"
        )

    # ---- state
    def state_dict_payload(self) -> dict[str, Any]:
        return {}

    def load_payload(self, payload: Mapping[str, Any]) -> None:
        pass

    def get_extra_state(self) -> dict[str, Any]:
        return self.state_dict_payload()

    def set_extra_state(self, state: Mapping[str, Any]) -> None:
        self.load_payload(state)
