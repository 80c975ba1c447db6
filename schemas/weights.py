"""The wire format of a weight version: a state dict that crosses Ray's object store as raw
buffers — one copy to publish, none to read.

Pickling a torch state dict copies every tensor's bytes into a pickle stream, and unpickling
copies them out again. `SharedStateDict` instead pickles each tensor as a flat uint8 numpy view,
which Ray's serialiser (pickle protocol 5) passes out-of-band: `ray.put` copies the bytes once,
straight from the parameters into shared memory (no `clone()` before), and `ray.get` on the same
node returns tensors that *are* that shared memory, copying nothing (benchmarks/results/
publish.md has both ways per model size; `python -m benchmarks.run_all --only publish`).

This module does not import torch: a process that only passes versions on (the policy store,
which copies a run's final version into its own ownership) unpickles one into its raw buffers and
re-puts them without loading torch (seconds of import and a few hundred MB per process): a
`PackedStateDict`, as is version 0 read from a model's files (engines/model_files.py).

Contract: the tensors a reader gets are read-only. They view memory every reader on the node
shares, so writing into one would change the weights for all of them; copy them into a model
(`load_state_dict`) or `.clone()` before modifying. Tied parameters (one tensor under two names)
travel once and come back tied.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


class SharedStateDict(dict):
    """name -> tensor, serialised without copying tensor data into the pickle stream."""

    @classmethod
    def of(cls, tensors: "Mapping[str, torch.Tensor] | torch.nn.Module", dtype: "torch.dtype | None | str" = "float32",
           ) -> "SharedStateDict":
        """Views of `tensors` (a module's state dict, or a mapping) on the CPU, detached,
        contiguous and in `dtype` (None: keep each tensor's dtype). Nothing is copied unless a
        tensor has to move, change dtype or become contiguous: `ray.put` makes the one copy."""
        import torch

        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if isinstance(tensors, torch.nn.Module):
            tensors = tensors.state_dict()
        return cls({name: t.detach().to(device="cpu", dtype=dtype or t.dtype).contiguous()
                    for name, t in tensors.items()})

    @property
    def nbytes(self) -> int:
        """Bytes of distinct tensors (a tied tensor counts once)."""
        return sum(t.numel() * t.element_size() for t in _distinct(self).values())

    def __reduce__(self):
        import torch

        distinct = _distinct(self)
        slot = {key: i for i, key in enumerate(distinct)}
        buffers = [t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
                   for t in distinct.values()]
        specs = [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in distinct.values()]
        return _rebuild, (list(self), [slot[_key(t)] for t in self.values()], buffers, specs)


def _key(t: "torch.Tensor") -> tuple:
    return t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride())


def _distinct(state: "Mapping[str, torch.Tensor]") -> "dict[tuple, torch.Tensor]":
    distinct: dict = {}
    for t in state.values():
        distinct.setdefault(_key(t), t)
    return distinct


def _rebuild(names: list[str], slots: list[int], buffers: list[np.ndarray],
             specs: list[tuple[str, tuple[int, ...]]]) -> "SharedStateDict | PackedStateDict":
    if "torch" not in sys.modules:  # a process that only passes weights on (the policy store)
        return PackedStateDict(names, slots, buffers, specs)
    import torch

    with warnings.catch_warnings():  # read-only by contract (see the module docstring)
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensors = [torch.from_numpy(b).view(getattr(torch, dtype)).reshape(shape)
                   for b, (dtype, shape) in zip(buffers, specs)]
    return SharedStateDict((name, tensors[i]) for name, i in zip(names, slots))


class PackedStateDict:
    """A version as raw buffers, in a process without torch (the policy store passing one on, the
    driver publishing version 0 from the model's files: engines/model_files.py); put again, it
    travels (and arrives) exactly as a SharedStateDict: names, the slot of each name's tensor
    (tied names share one), each tensor's bytes, its dtype and shape."""

    def __init__(self, *parts) -> None:
        self.parts = parts

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors the names use (a tied tensor counts once)."""
        _, slots, buffers, _ = self.parts
        return sum(buffers[i].nbytes for i in set(slots))

    def __reduce__(self):
        return _rebuild, self.parts
