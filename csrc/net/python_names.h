// A constant shared with Python, under the name Python reads it by (`_C.control.<name>`, `_C.wire.<name>`,
// bound in net/bindings.cpp), so each is defined once, here in C++.
#pragma once

namespace gear {

template <typename T>
struct PythonName {
  const char* name;
  T value;
};

}  // namespace gear
