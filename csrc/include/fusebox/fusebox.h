// Umbrella header of the fusebox C++ API.
#pragma once

#include "fusebox/error.h"
#include "fusebox/ops.h"
#include "fusebox/tensor.h"

#define FUSEBOX_VERSION "0.1.0"
