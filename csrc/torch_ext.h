// The torch side of an extension: ATen's tensors, factories and parallel_for, and pybind11 with torch's tensor type
// casters. Not <torch/extension.h>, which parses the whole libtorch C++ API (about 20 s of every build, against 8).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;
