// Binds the network owner and receiver (native owner, replies, framing, the numbers Python shares with them)
// into `_C`.
#pragma once

#include <pybind11/pybind11.h>

void bind_net(pybind11::module_& m);
