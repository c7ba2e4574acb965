// Positive controls for compute-sanitizer's racecheck (issue 42, item 3), in plain CUDA.
//
// On an H100, racecheck reported 0 hazards on jfp8's planted race (benchmarks/gpu_mutants.py, a
// Mosaic GPU kernel whose consumer releases an SMEM stage before reading it) and on everything
// else. Three explanations fit: racecheck does not work in that environment at all; it works but
// does not treat mbarrier-ordered accesses as it treats __syncthreads; or it works but does not
// instrument Mosaic GPU's kernels. These kernels tell them apart, each run in a process of its own
// (`racecheck_controls KERNEL`):
//
//   unsynced        256 threads write a shared array and read a neighbour warp's element with no
//                   barrier between: the textbook hazard racecheck documents. Flagged unless the
//                   tool itself is blind here.
//   synced          the same with __syncthreads() between: must not be flagged.
//   early_release   the Mosaic mutant's pipeline in CUDA: a producer group of 128 threads writes a
//                   one-slot stage and arrives on an mbarrier ("produced"); the consumer group
//                   waits on it, arrives on "consumed" BEFORE reading the stage, and the producer
//                   overwrites it after waiting on "consumed". Flagged only if racecheck orders
//                   accesses by mbarrier phases.
//   clean_release   the same with the consumer's arrive after its read: must not be flagged (if it
//                   is, racecheck does not count mbarriers as synchronization at all).
//
// Each run checks what it can (the clean kernels' outputs must be exact) and prints one line
// `RACECHECK_CONTROL {"kernel": ..., "ok": ..., ...}`. `--check` prints the device and driver.
// Built by racecheck_controls.py (sm_90a, CUDA runtime linked statically); nothing here is jfp8's
// library code.

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

constexpr int kThreads = 256;  // two groups of 128 (a warpgroup each)
constexpr int kGroup = 128;
constexpr int kSteps = 8;

__global__ void unsynced_kernel(float* out, bool sync) {
  __shared__ float shared[kThreads];
  const int t = threadIdx.x;
  shared[t] = static_cast<float>(t);
  if (sync) __syncthreads();
  out[t] = shared[(t + 32) % kThreads];  // another warp's element
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile(
      "{\n\t.reg .b64 state;\n\t"
      "mbarrier.arrive.shared::cta.b64 state, [%0];\n\t}" ::"r"(smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n\t.reg .pred done;\n\t"
      "WAIT_%=:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
      "@!done bra WAIT_%=;\n\t}" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// in, out: kSteps x kGroup floats. Threads [0, 128) consume, [128, 256) produce.
__global__ void release_kernel(const float* in, float* out, bool early_release) {
  __shared__ float stage[kGroup];
  __shared__ uint64_t produced, consumed;
  const int t = threadIdx.x;
  if (t == 0) {
    mbar_init(&produced, kGroup);  // every thread of a group arrives
    mbar_init(&consumed, kGroup);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (t >= kGroup) {  // producer
    const int i = t - kGroup;
    for (int step = 0; step < kSteps; ++step) {
      if (step) mbar_wait(&consumed, (step - 1) & 1);  // the stage is free again
      stage[(i + 32) % kGroup] = in[step * kGroup + (i + 32) % kGroup];  // another warp reads it
      mbar_arrive(&produced);
    }
    mbar_wait(&consumed, (kSteps - 1) & 1);
  } else {  // consumer
    for (int step = 0; step < kSteps; ++step) {
      mbar_wait(&produced, step & 1);
      if (early_release) mbar_arrive(&consumed);  // the bug: released before it is read
      out[step * kGroup + t] = stage[t];
      if (!early_release) mbar_arrive(&consumed);
    }
  }
}

int fail(const char* kernel, const char* what, cudaError_t err) {
  std::printf("RACECHECK_CONTROL {\"kernel\": \"%s\", \"ok\": false, \"error\": \"%s: %s\"}\n", kernel, what,
              cudaGetErrorString(err));
  return 1;
}

int check_device() {
  int device = 0, driver = 0, runtime = 0;
  cudaDeviceProp prop;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaGetDeviceProperties(&prop, device);
  if (err != cudaSuccess) return fail("check", "device", err);
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  std::printf("RACECHECK_CONTROL {\"kernel\": \"check\", \"ok\": %s, \"device\": \"%s\", \"sm\": %d%d, "
              "\"driver\": %d, \"runtime\": %d}\n",
              prop.major == 9 ? "true" : "false", prop.name, prop.major, prop.minor, driver, runtime);
  return prop.major == 9 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s unsynced|synced|early_release|clean_release|--check\n", argv[0]);
    return 2;
  }
  const char* kernel = argv[1];
  if (!std::strcmp(kernel, "--check")) return check_device();
  const bool pipeline = !std::strcmp(kernel, "early_release") || !std::strcmp(kernel, "clean_release");
  const bool barrier = !std::strcmp(kernel, "synced");
  if (!pipeline && !barrier && std::strcmp(kernel, "unsynced")) {
    std::fprintf(stderr, "unknown kernel %s\n", kernel);
    return 2;
  }
  const int n = pipeline ? kSteps * kGroup : kThreads;
  std::vector<float> host_in(n), host_out(n, -1.0f);
  for (int i = 0; i < n; ++i) host_in[i] = static_cast<float>(i) + 0.5f;
  float *in = nullptr, *out = nullptr;
  cudaError_t err = cudaMalloc(&in, n * sizeof(float));
  if (err == cudaSuccess) err = cudaMalloc(&out, n * sizeof(float));
  if (err == cudaSuccess) err = cudaMemcpy(in, host_in.data(), n * sizeof(float), cudaMemcpyHostToDevice);
  if (err == cudaSuccess) err = cudaMemset(out, 0xff, n * sizeof(float));  // poisoned: NaN
  if (err != cudaSuccess) return fail(kernel, "setup", err);
  if (pipeline) {
    release_kernel<<<1, kThreads>>>(in, out, !std::strcmp(kernel, "early_release"));
  } else {
    unsynced_kernel<<<1, kThreads>>>(out, barrier);
  }
  err = cudaGetLastError();
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err == cudaSuccess) err = cudaMemcpy(host_out.data(), out, n * sizeof(float), cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) return fail(kernel, "run", err);
  int wrong = 0;
  for (int i = 0; i < n; ++i) {
    const float want = pipeline ? host_in[i] : static_cast<float>((i + 32) % kThreads);
    wrong += host_out[i] != want;
  }
  // The racy kernels' outputs are whatever the race gave; only the clean ones must be exact.
  const bool clean = barrier || !std::strcmp(kernel, "clean_release");
  const bool ok = !clean || wrong == 0;
  std::printf("RACECHECK_CONTROL {\"kernel\": \"%s\", \"ok\": %s, \"racy\": %s, \"wrong\": %d, \"of\": %d}\n", kernel,
              ok ? "true" : "false", clean ? "false" : "true", wrong, n);
  cudaFree(in);
  cudaFree(out);
  return ok ? 0 : 1;
}
