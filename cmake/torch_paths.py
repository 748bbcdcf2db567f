"""Print torch's build facts as CMake `set()` lines.

find_package(Torch) fails for a C++-only build against a CUDA torch, so the
build takes include/library paths from torch.utils.cpp_extension instead.
"""
import glob
import os

import torch
import torch.utils.cpp_extension as cpp_extension


def cmake_list(items):
    return ";".join(p.replace("\\", "/") for p in items)


site_packages = os.path.dirname(os.path.dirname(torch.__file__))
facts = {
    "TORCH_INCLUDE_DIRS": cmake_list(cpp_extension.include_paths()),
    "TORCH_LIBRARY_DIRS": cmake_list(cpp_extension.library_paths()),
    "TORCH_CUDA_VERSION": torch.version.cuda or "",
    "TORCH_CXX11_ABI": str(int(torch._C._GLIBCXX_USE_CXX11_ABI)),
    # Some torch CUDA headers include cuBLAS/cuSPARSE headers that only the
    # pip wheels ship.
    "NVIDIA_WHEEL_INCLUDE_DIRS": cmake_list(glob.glob(os.path.join(site_packages, "nvidia", "*", "include"))),
}
for name, value in facts.items():
    print(f'set({name} "{value}")')
