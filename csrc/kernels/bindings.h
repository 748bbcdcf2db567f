// Binds the kernels (gather, trees, window geometry, priorities, episode indices, packing, shares) into `_C`.
#pragma once

#include <pybind11/pybind11.h>

void bind_kernels(pybind11::module_& m);
