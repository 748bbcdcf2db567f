"""Replaying a short sequence of small GPU ops as one CUDA graph.

Sampling and updating priorities on the GPU is dozens of tiny kernels; their
launches, not their work, set the time. Captured once per input signature, the
same Python function replays as a single graph launch. CPU tensors, and any
function that cannot be captured, simply run eagerly: the graph is a cache,
never a second implementation.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

log = logging.getLogger(__name__)

# CUDA graphs need PyTorch's caching allocator; tools such as compute-sanitizer run without it.
_CACHING_ALLOCATOR = os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") in ("", "0")

_Signature = tuple[tuple[torch.Size, torch.dtype, torch.device], ...]
Result = TypeVar("Result", torch.Tensor, None)
_Captured = tuple[list[torch.Tensor], torch.cuda.CUDAGraph, Result]  # static inputs, the graph, its output


class GraphedCall(Generic[Result]):
    """``fn(*tensors)``, replayed from a CUDA graph per input signature (shapes, dtypes, device).

    ``fn`` must not synchronize with the host or produce data-dependent shapes,
    must keep the storage of every tensor it touches besides its arguments (the
    graph holds their addresses), and must give the same result when called
    again with the same arguments: capture runs it twice on a side stream first,
    as CUDA graphs need. It returns None or one tensor.

    Calls with more than ``max_elements`` in their first argument run eagerly:
    their work outweighs the launches, and a graph would keep their
    intermediates allocated for good.
    """

    def __init__(self, fn: Callable[..., Result], max_graphs: int = 8, max_elements: int = 1 << 16) -> None:
        self.fn: Callable[..., Result] = fn
        self.max_graphs = max_graphs
        self.max_elements = max_elements
        self._graphs: dict[_Signature, _Captured[Result]] = {}
        self._capturable = _CACHING_ALLOCATOR

    def __call__(self, *args: torch.Tensor) -> Result:
        if (
            not (self._capturable and args[0].is_cuda)
            or args[0].numel() > self.max_elements
            or torch.cuda.is_current_stream_capturing()
        ):  # inside another capture: be part of it
            return self.fn(*args)
        signature = tuple((a.shape, a.dtype, a.device) for a in args)
        entry = self._graphs.get(signature)
        if entry is None:
            if len(self._graphs) >= self.max_graphs:
                return self.fn(*args)
            entry = self._capture(args)
            if entry is None:
                return self.fn(*args)
            self._graphs[signature] = entry
        inputs, graph, output = entry
        for static, arg in zip(inputs, args):
            static.copy_(arg)
        if args[0].device.index == torch.cuda.current_device():
            graph.replay()
        else:  # the usual case above skips the device switch: replays are meant to cost microseconds
            with torch.cuda.device(args[0].device):
                graph.replay()
        return None if output is None else output.clone()

    def _capture(self, args: tuple[torch.Tensor, ...]) -> _Captured[Result] | None:
        device = args[0].device
        inputs = [a.clone() for a in args]
        try:
            with torch.cuda.device(device):  # capture on the arguments' device, whichever is current
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):  # lazy library initialization must not happen inside the capture
                        self.fn(*inputs)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    output = self.fn(*inputs)
        except RuntimeError as err:  # an op that cannot be captured: stay eager from now on
            log.warning("%s runs without a CUDA graph: %s", getattr(self.fn, "__qualname__", self.fn), err)
            self._capturable = False
            return None
        return inputs, graph, output

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_graphs": {}}  # graphs belong to this process's device context
