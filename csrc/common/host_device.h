// FUSEBOX_HD marks small math helpers compiled for both the CPU reference and the kernels.
#pragma once

#if defined(__CUDACC__)
#define FUSEBOX_HD __host__ __device__ __forceinline__
#else
#define FUSEBOX_HD inline
#endif
