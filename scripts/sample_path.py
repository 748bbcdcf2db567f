"""The path of one ``rb.sample()`` through this package: which of our functions and types it runs.

    .venv/bin/python scripts/sample_path.py

Traces one ``rb.sample()`` (after a warm-up one) over a ``GearStorage`` with TorchRL's
``RandomSampler`` and with ``GearSequenceSampler``, and lists every function of
``gear_torchrl`` it calls (by module and qualified name) and every type of ours on the
way: the classes those functions belong to and the types of the values they return.
``_C`` calls are listed apart. docs/architecture.md quotes what this prints.
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


def _ours(module: str | None) -> bool:
    return bool(module) and (module == "gear_torchrl" or module.startswith("gear_torchrl."))  # type: ignore[union-attr]


def trace(call: Callable[[], Any]) -> tuple[list[str], list[str], list[str]]:
    """Our functions, our types and the ``_C`` functions ``call()`` runs, in first-call order."""
    functions: dict[str, None] = {}
    types: dict[str, None] = {}
    kernels: dict[str, None] = {}

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call" and getattr(arg, "__module__", None) == "gear_torchrl.kernels._C":
            kernels[f"_C.{arg.__name__}"] = None
        code = frame.f_code
        if not code.co_filename.startswith(PACKAGE):
            return
        if event == "call":
            module = frame.f_globals.get("__name__", "?")
            functions[f"{module}:{code.co_qualname}"] = None
            owner = code.co_qualname.split(".")[0]
            if "." in code.co_qualname and owner != "<locals>" and isinstance(frame.f_globals.get(owner), type):
                types[f"{module}:{owner}"] = None
        elif event == "return" and arg is not None and _ours(type(arg).__module__):
            types[f"{type(arg).__module__}:{type(arg).__qualname__}"] = None

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return list(functions), list(types), list(kernels)


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
    cases = {"RandomSampler": _buffer(RandomSampler(), 256),
             "GearSequenceSampler": _buffer(GearSequenceSampler(slice_len=16), 256)}
    for name, rb in cases.items():
        rb.sample()  # warm-up: first-use set-up is not the path of a batch
        functions, types, kernels = trace(rb.sample)
        print(f"## rb.sample() with {name}: {len(functions)} functions, {len(types)} types of ours")
        print("functions:", *functions, sep="\n  ")
        print("types:", *types, sep="\n  ")
        print("_C:", *kernels, sep="\n  ")


if __name__ == "__main__":
    main()
