"""The path of one ``rb.sample()`` through this package: which of our functions and types it runs.

    .venv/bin/python scripts/sample_path.py

Traces one ``rb.sample()`` (after a warm-up one) over a ``GearStorage`` with TorchRL's
``RandomSampler`` and with ``GearSequenceSampler``. The *path* is every function of
``gear_torchrl`` on the stack when a ``_C`` function is called (from TorchRL's call down
to the kernel), its *types* the classes those functions belong to and the types of ours
they return; everything else of ours the call runs (property reads, the batch built
after the gather) is counted apart. docs/architecture.md quotes what this prints.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from tensordict import TensorDict
from torchrl.data import RandomSampler, TensorDictReplayBuffer

import gear_torchrl
from gear_torchrl import GearSequenceSampler, GearStorage

PACKAGE = str(Path(gear_torchrl.__file__).resolve().parent)


def _ours(module: str) -> bool:
    return module == "gear_torchrl" or module.startswith("gear_torchrl.")


def _name(frame: FrameType) -> str | None:
    """``module:qualname`` of a frame running our code (comprehensions are their function's), else None."""
    code = frame.f_code
    if not code.co_filename.startswith(PACKAGE) or code.co_name.startswith("<"):
        return None
    return f"{frame.f_globals.get('__name__', '?')}:{code.co_qualname}"


class Trace:
    """What one call runs of ours: the path to ``_C`` (functions, types), the other functions, the kernels."""

    def __init__(self) -> None:
        self.path: dict[str, None] = {}
        self.types: dict[str, None] = {}
        self.other: dict[str, None] = {}
        self.kernels: dict[str, None] = {}
        self._returned: dict[str, str] = {}  # function -> the type of ours it returned

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call" and getattr(arg, "__module__", None) == "gear_torchrl.kernels._C":
            self.kernels[f"_C.{arg.__name__}"] = None
            on_stack: FrameType | None = frame
            while on_stack is not None:
                name = _name(on_stack)
                if name is not None:
                    self.path[name] = None
                on_stack = on_stack.f_back
            return
        name = _name(frame)
        if name is None:
            return
        if event == "call":
            self.other[name] = None
        elif event == "return" and arg is not None and _ours(type(arg).__module__):
            self._returned[name] = f"{type(arg).__module__}:{type(arg).__qualname__}"

    def run(self, call: Callable[[], Any]) -> None:
        sys.setprofile(self.profile)
        try:
            call()
        finally:
            sys.setprofile(None)
        for name in self.path:  # the class a method belongs to, and what the function returned of ours
            module, qualname = name.split(":")
            owner = f"{module}:{qualname.split('.')[0]}" if "." in qualname else None
            for t in (owner, self._returned.get(name)):
                if t is not None:
                    self.types[t] = None
        self.other = {n: None for n in self.other if n not in self.path}


def _buffer(sampler: Any, batch_size: int) -> TensorDictReplayBuffer:
    storage = GearStorage(4096)
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=batch_size)
    steps = 2048
    done = torch.zeros(steps, 1, dtype=torch.bool)
    done[99::100] = True
    rb.extend(TensorDict({"obs": torch.randn(steps, 8), "next": {"done": done}}, batch_size=[steps]))
    return rb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    cases = {
        "RandomSampler": _buffer(RandomSampler(), 256),
        "GearSequenceSampler": _buffer(GearSequenceSampler(slice_len=16), 256),
    }
    for name, rb in cases.items():
        rb.sample()  # warm-up: first-use set-up is not the path of a batch
        trace = Trace()
        trace.run(rb.sample)
        print(
            f"## rb.sample() with {name}: {len(trace.path)} functions and {len(trace.types)} types of ours on "
            f"the path to _C; {len(trace.other)} other functions of ours"
        )
        print("path:", *trace.path, sep="\n  ")
        print("types:", *trace.types, sep="\n  ")
        print("_C:", *trace.kernels, sep="\n  ")
        print("other:", *trace.other, sep="\n  ")


if __name__ == "__main__":
    main()
