// SPEC §6: batch expansion of a learned initial bank and its gradient.
//   expand: out[b*S*D + i] = param[i]            (grid-stride over B*S*D elements)
//   sum   : out[i] = sum_b grad[b*S*D + i]       (accumulated in A, fixed order over b)

#include "sdm_common.cuh"

namespace sdm {

template <typename T>
__global__ void sdm_expand_kernel(const T* __restrict__ param, T* __restrict__ out,
                                  long long SD, int B) {
  const long long n = SD * B;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x)
    out[i] = param[i % SD];
}

template <typename T, typename A>
__global__ void sdm_sum_kernel(const T* __restrict__ grad, T* __restrict__ out, long long SD,
                               int B) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < SD;
       i += (long long)gridDim.x * blockDim.x) {
    A s = A(0);
    for (int b = 0; b < B; ++b) s += to_acc(grad[b * SD + i], A());
    out[i] = From<T>::cvt(s);
  }
}

}  // namespace sdm
