// The extension `gear_torchrl.kernels._C`: the kernels (csrc/kernels/) and the network owner and receiver built
// on them (csrc/net/), each bound by its own bindings.cpp.
#include <torch/extension.h>

#include "kernels/bindings.h"
#include "net/bindings.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "gear_torchrl's extension: gather, trees, window geometry, episode indices (kernels); the native "
            "owner, framed replies and the control segment's words (net)";
  bind_kernels(m);
  bind_net(m);
}
