"""The thin torchrl ``Transform`` shell shared by the write-path transforms.

torchrl 0.14 routes ``rb.append_transform(t, invert=True)`` through ``_InvertTransform``:
on ``rb.extend`` the buffer calls ``Compose.inv`` -> ``_InvertTransform._inv_call`` ->
``t._call(data)``; on ``rb.sample`` it calls ``_InvertTransform.forward`` -> ``t.inv(data)``.
So here ``_call`` (and ``forward``, for direct calls ``t(batch)``) runs the write-path
computation, and ``inv`` passes sampled data through untouched. ``Compose`` runs the
inverse chain last-appended-first, and passes ``None`` (a group not complete yet) down
the chain, so every transform returns ``None`` for ``None``; torchrl's ``extend`` then
stores nothing and returns empty indices.

Attached without ``invert=True``, torchrl would call ``_inv_call`` on writes and
``forward`` on samples (the computation would run on sampled batches), so ``_inv_call``
raises an error that says how to attach.

State: ``nn.Module.state_dict`` recursion reaches a transform inside the buffer's
``Compose`` only through ``get_extra_state`` / ``set_extra_state``, so that is where
each transform's state goes; ``rb.state_dict()`` and ``rb.dumps`` then carry it.
Payloads hold only tensors, numbers, strings and lists, so ``torch.load(weights_only=True)``
reads them.
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
