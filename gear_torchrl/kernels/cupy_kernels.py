"""The CUDA gather without the extension's CUDA part: the same kernel source, compiled by CuPy.

A ``pip install`` on a machine without nvcc builds only the C++ part; on a
GPU machine with CuPy this module compiles ``csrc/kernels/cuda/gather_kernel.cuh``
(shipped in the package as ``gear_torchrl/kernels/gather_kernel.cuh``) with
NVRTC at first use and launches it with the calling convention documented at
the top of that file. Nothing here is a copy of the kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

_PACKAGE_KERNEL = Path(__file__).parent / "gather_kernel.cuh"
_SOURCE_KERNEL = Path(__file__).parents[2] / "csrc" / "kernels" / "cuda" / "gather_kernel.cuh"
# The launch constants of csrc/kernels/cuda/gather_kernel.cuh (GEAR_*).
_THREADS = 256
_MASK_WINDOWS = 32
_DESC_WORDS = 5
_MAX_LAUNCH_COLUMNS = 1024
_CHUNK_BYTES = 2048


def kernel_source_path() -> Path:
    for path in (_PACKAGE_KERNEL, _SOURCE_KERNEL):
        if path.exists():
            return path
    raise FileNotFoundError(f"gather kernel source not found at {_PACKAGE_KERNEL} or {_SOURCE_KERNEL}")


def unavailable_reason() -> str | None:
    """None when the CuPy path can run, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "CuPy is not installed (pip install cupy-cuda13x)"
    try:
        kernel_source_path()
    except FileNotFoundError as err:
        return str(err)
    return None


@functools.cache
def _kernel(device_index: int):
    import cupy as cp

    with cp.cuda.Device(device_index):
        module = cp.RawModule(code=kernel_source_path().read_text(), options=("--std=c++17",))
        return module.get_function("gear_gather_kernel")


def _device_address(column: torch.Tensor, index: int) -> int:
    if column.is_cuda:
        return column.data_ptr()
    import cupy as cp

    try:
        attributes = cp.cuda.runtime.pointerGetAttributes(column.data_ptr())
    except cp.cuda.runtime.CUDARuntimeError as err:
        raise RuntimeError(f"gather: column {index} is pageable CPU memory the GPU cannot read; pin it") from err
    if attributes.type != cp.cuda.runtime.memoryTypeHost or not attributes.devicePointer:
        raise RuntimeError(
            f"gather: column {index} is pageable CPU memory the GPU cannot read in place; "
            "pin it with .pin_memory() or gear_torchrl.kernels.gather.host_register()"
        )
    return int(attributes.devicePointer)


def gather(
    columns: list[torch.Tensor],
    out: list[torch.Tensor],
    starts: torch.Tensor,
    valid_begin: torch.Tensor | None,
    valid_end: torch.Tensor | None,
    window_len: int,
    mask: torch.Tensor | None,
    hot_columns: Sequence[torch.Tensor] = (),
    hot_owner: torch.Tensor | None = None,
) -> None:
    """Same contract as ``_C.gather`` for CUDA outputs (see csrc/kernels/gather.h)."""
    import cupy as cp

    device = out[0].device
    num_windows, capacity = starts.numel(), columns[0].shape[0]
    if num_windows == 0:
        return

    def on_device(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, torch.int64, non_blocking=True)

    def pointer(t: torch.Tensor | None) -> np.uint64:
        return np.uint64(0 if t is None else t.data_ptr())

    starts_d, begin_d, end_d = on_device(starts), on_device(valid_begin), on_device(valid_end)
    hot_rows = 0 if hot_owner is None else hot_owner.numel()
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream)
    for first in range(0, len(columns), _MAX_LAUNCH_COLUMNS):  # descriptors fill shared memory
        group = range(first, min(first + _MAX_LAUNCH_COLUMNS, len(columns)))
        descriptors, items = [], 0
        for c in group:
            row_bytes = columns[c][0].numel() * columns[c].element_size() if capacity else 0
            hot = 0 if hot_owner is None else hot_columns[c].data_ptr()
            descriptors += [_device_address(columns[c], c), out[c].data_ptr(), row_bytes, items, hot]
            items += num_windows * ((row_bytes * window_len + _CHUNK_BYTES - 1) // _CHUNK_BYTES)
        copy_items = items
        group_mask = mask if first == 0 else None
        if group_mask is not None:
            items += (num_windows + _MASK_WINDOWS - 1) // _MASK_WINDOWS
        if items == 0:
            continue
        desc = torch.tensor(np.array(descriptors, dtype=np.uint64).view(np.int64), device=device)
        blocks = (items + _THREADS // 32 - 1) // (_THREADS // 32)
        with cp.cuda.Device(device.index), stream:
            _kernel(device.index)(
                (blocks,),
                (_THREADS,),
                (
                    pointer(desc),
                    np.int32(len(group)),
                    pointer(starts_d),
                    pointer(begin_d),
                    pointer(end_d),
                    pointer(group_mask),
                    np.int64(num_windows),
                    np.int64(window_len),
                    np.int64(capacity),
                    np.int64(_CHUNK_BYTES),
                    np.int64(copy_items),
                    np.int64(items),
                    pointer(hot_owner),
                    np.int64(hot_rows),
                ),
                shared_mem=len(group) * _DESC_WORDS * 8,
            )


def host_register(tensor: torch.Tensor) -> None:
    import cupy as cp

    nbytes = tensor.numel() * tensor.element_size()
    cp.cuda.runtime.hostRegister(tensor.data_ptr(), nbytes, 0x02 | 0x01)  # mapped | portable


def host_unregister(tensor: torch.Tensor) -> None:
    import cupy as cp

    cp.cuda.runtime.hostUnregister(tensor.data_ptr())
