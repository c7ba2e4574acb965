// A host program that times DeepGEMM's SM90 FP8 GEMM (`sm90_fp8_gemm_1d2d_impl`: 1x128 activation
// scales, 128x128 weight scales, bf16 output) on operands written by jfp8's dense benchmark, so
// that its rows sit beside jfp8's and torch's from the same call on the same GPU (issue 45).
//
// The host code here is jfp8's; the kernel is DeepGEMM's, instantiated with the template arguments
// its own SM90 heuristics pick (`benchmarks/hopper/anchors.py`), one instantiation per problem, in
// the generated `deepgemm_kernels.inc` (`benchmarks/hopper/deepgemm_harness.py --build`).
//
//   deepgemm_harness --check                           device and driver, as one JSON line
//   deepgemm_harness M N K G DIR WARMUP REPEATS INNER  DIR/{a,sfa,b,sfb}.bin in, DIR/d.bin out
//
// Inputs (raw little-endian bytes): a [M, K] e4m3, sfa [ceil(K/128), align(M, 4)] f32 (K-chunk
// major, rows padded to 16 bytes: DeepGEMM's TMA layout), b [G, N, K] e4m3 (K-major), sfb
// [G, ceil(N/128), ceil(K/128)] f32; with G > 1 (the MoE kernel, DeepGEMM's m-grouped contiguous
// layout) also layout [M] int32, each row's group (-1: a padding row), groups in whole BLOCK_M
// row blocks. Output: d [M, N] bf16 of the last launch. After WARMUP launches, REPEATS samples,
// each INNER back-to-back launches on the default stream between one pair of CUDA events (the
// benchmarks' own timing: inner calls, one synchronisation); the JSON line on stdout holds each
// sample's milliseconds per launch. Exit status: 0 done, 2 bad arguments or no instantiation for
// (M, N, K, G), 3 no usable GPU or driver, 4 a CUDA error (the line says which call).

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh>

using namespace deep_gemm;

namespace {

struct Instantiation {
    uint32_t m, n, k, groups;
    uint32_t block_m, block_n, stages, threads, multicast, swizzle_d, smem_bytes, num_sms;
    const void* kernel;
};

#include "deepgemm_kernels.inc"  // kInstantiations[] (generated)

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

[[noreturn]] void fail(int status, std::string what) {
    std::replace(what.begin(), what.end(), '"', '\'');  // the line stays JSON
    std::printf("{\"ok\": false, \"error\": \"%s\"}\n", what.c_str());
    std::exit(status);
}

void check(cudaError_t err, const char* call) {
    if (err != cudaSuccess) fail(4, std::string(call) + ": " + cudaGetErrorName(err) + " " + cudaGetErrorString(err));
}

EncodeTiled encode_tiled() {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    check(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found),
          "cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)");
    if (found != cudaDriverEntryPointSuccess or fn == nullptr) fail(3, "the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<EncodeTiled>(fn);
}

CUtensorMapSwizzle swizzle_of(uint32_t bytes) {
    switch (bytes) {
        case 0: return CU_TENSOR_MAP_SWIZZLE_NONE;
        case 32: return CU_TENSOR_MAP_SWIZZLE_32B;
        case 64: return CU_TENSOR_MAP_SWIZZLE_64B;
        case 128: return CU_TENSOR_MAP_SWIZZLE_128B;
        default: fail(2, "unsupported swizzle width " + std::to_string(bytes));
    }
}

// A 2-D tensor map: `inner` x `outer` elements of `elem_bytes` each, rows `row_bytes` apart, boxes of
// `box_inner` x `box_outer` (with a swizzle the box's inner extent is the swizzle's width).
CUtensorMap tensor_map(EncodeTiled encode, CUtensorMapDataType dtype, void* base, uint64_t inner, uint64_t outer,
                       uint64_t row_bytes, uint32_t box_inner, uint32_t box_outer, uint32_t swizzle_bytes,
                       uint32_t elem_bytes, const char* name) {
    if (swizzle_bytes) box_inner = swizzle_bytes / elem_bytes;
    CUtensorMap map;
    const cuuint64_t dims[2] = {inner, outer};
    const cuuint64_t strides[1] = {row_bytes};
    const cuuint32_t box[2] = {box_inner, box_outer};
    const cuuint32_t elem_strides[2] = {1, 1};
    CUresult r = encode(&map, dtype, 2, base, dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                        swizzle_of(swizzle_bytes), CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) fail(4, std::string("cuTensorMapEncodeTiled(") + name + ") returned " + std::to_string(r));
    return map;
}

std::vector<char> read_file(const std::string& path, size_t bytes) {
    std::vector<char> data(bytes);
    FILE* f = std::fopen(path.c_str(), "rb");
    if (!f) fail(2, "cannot open " + path);
    size_t got = std::fread(data.data(), 1, bytes, f);
    bool more = std::fgetc(f) != EOF;
    std::fclose(f);
    if (got != bytes or more) fail(2, path + " does not hold " + std::to_string(bytes) + " bytes");
    return data;
}

void* to_device(const std::vector<char>& host, const char* name) {
    void* ptr = nullptr;
    check(cudaMalloc(&ptr, host.size()), name);
    check(cudaMemcpy(ptr, host.data(), host.size(), cudaMemcpyHostToDevice), name);
    return ptr;
}

int device_check(bool print) {
    int driver = 0, runtime = 0, count = 0;
    cudaDriverGetVersion(&driver);
    cudaRuntimeGetVersion(&runtime);
    if (driver == 0) fail(3, "no CUDA driver (cudaDriverGetVersion gave 0)");
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess or count == 0) fail(3, std::string("no CUDA device: ") + cudaGetErrorString(err));
    cudaDeviceProp prop;
    check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    if (prop.major != 9 or prop.minor != 0) fail(3, std::string("not an sm_90 GPU: ") + prop.name);
    if (print)
        std::printf("{\"ok\": true, \"device\": \"%s\", \"sms\": %d, \"driver\": %d, \"runtime\": %d, "
                    "\"instantiations\": %zu}\n", prop.name, prop.multiProcessorCount, driver, runtime,
                    sizeof(kInstantiations) / sizeof(kInstantiations[0]));
    return prop.multiProcessorCount;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc == 2 and std::string(argv[1]) == "--check") {
        device_check(true);
        return 0;
    }
    if (argc != 9) fail(2, "usage: deepgemm_harness --check | M N K G DIR WARMUP REPEATS INNER");
    const uint32_t m = std::atoi(argv[1]), n = std::atoi(argv[2]), k = std::atoi(argv[3]), groups = std::atoi(argv[4]);
    const std::string dir = argv[5];
    const int warmup = std::atoi(argv[6]), repeats = std::atoi(argv[7]), inner = std::atoi(argv[8]);
    if (m == 0 or n == 0 or k == 0 or groups == 0 or n % 8 or k % 128 or repeats < 1 or inner < 1 or warmup < 0)
        fail(2, "M, N, K, G must be positive, N a multiple of 8, K of 128; REPEATS, INNER >= 1, WARMUP >= 0");

    const Instantiation* inst = nullptr;
    for (const auto& i : kInstantiations)
        if (i.m == m and i.n == n and i.k == k and i.groups == groups) inst = &i;
    if (!inst) fail(2, "no DeepGEMM instantiation for " + std::to_string(m) + "x" + std::to_string(n) + "x" +
                       std::to_string(k) + " in " + std::to_string(groups) + " group(s): rebuild with "
                       "benchmarks/hopper/deepgemm_harness.py --build");
    const int sms = device_check(false);
    if (static_cast<uint32_t>(sms) != inst->num_sms)
        fail(3, "the kernel was built for " + std::to_string(inst->num_sms) + " SMs, this GPU has " + std::to_string(sms));

    const uint32_t k_chunks = k / 128, m_aligned = (m + 3) / 4 * 4, n_blocks = (n + 127) / 128;
    void* a = to_device(read_file(dir + "/a.bin", size_t(m) * k), "a");
    void* sfa = to_device(read_file(dir + "/sfa.bin", size_t(k_chunks) * m_aligned * 4), "sfa");
    void* b = to_device(read_file(dir + "/b.bin", size_t(groups) * n * k), "b");
    void* sfb = to_device(read_file(dir + "/sfb.bin", size_t(groups) * n_blocks * k_chunks * 4), "sfb");
    void* layout = groups > 1 ? to_device(read_file(dir + "/layout.bin", size_t(m) * 4), "layout") : nullptr;
    void* d = nullptr;
    check(cudaMalloc(&d, size_t(m) * n * 2), "cudaMalloc(d)");
    check(cudaMemset(d, 0xff, size_t(m) * n * 2), "cudaMemset(d)");  // NaN until written

    EncodeTiled encode = encode_tiled();
    // As DeepGEMM's host code lays them out (csrc/jit_kernels/impls/runtime_utils.hpp): K-major fp8
    // boxes of BLOCK x 128 in the 128-byte swizzle, the output in BLOCK_M x (swizzle width) boxes,
    // a's scales as BLOCK_M x 1 boxes of the K-chunk-major f32 array.
    CUtensorMap map_a = tensor_map(encode, CU_TENSOR_MAP_DATA_TYPE_UINT8, a, k, m, k, 128, inst->block_m, 128, 1, "a");
    CUtensorMap map_b = tensor_map(encode, CU_TENSOR_MAP_DATA_TYPE_UINT8, b, k, uint64_t(n) * groups, k, 128,
                                   inst->block_n, 128, 1, "b");  // the groups' weights stacked along N
    CUtensorMap map_d = tensor_map(encode, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, d, n, m, uint64_t(n) * 2, inst->block_n,
                                   inst->block_m, inst->swizzle_d, 2, "d");
    CUtensorMap map_sfa = tensor_map(encode, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, sfa, m_aligned, k_chunks,
                                     uint64_t(m_aligned) * 4, inst->block_m, 1, 0, 4, "sfa");

    check(cudaFuncSetAttribute(inst->kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, inst->smem_bytes),
          "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(inst->num_sms, 1, 1);
    config.blockDim = dim3(inst->threads, 1, 1);
    config.dynamicSmemBytes = inst->smem_bytes;
    config.stream = nullptr;
    cudaLaunchAttribute cluster;
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = inst->multicast;
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    config.numAttrs = 1;
    float* sfb_f = static_cast<float*>(sfb);
    int* grouped_layout = static_cast<int*>(layout);
    uint32_t shape_m = m, shape_n = n, shape_k = k;
    void* args[] = {&sfb_f, &grouped_layout, &shape_m, &shape_n, &shape_k, &map_a, &map_b, &map_d, &map_sfa};

    auto launch = [&]() { check(cudaLaunchKernelExC(&config, inst->kernel, args), "cudaLaunchKernelExC"); };
    for (int i = 0; i < warmup; ++i) launch();
    check(cudaDeviceSynchronize(), "warm-up");

    std::vector<cudaEvent_t> events(2 * repeats);
    for (auto& e : events) check(cudaEventCreate(&e), "cudaEventCreate");
    for (int i = 0; i < repeats; ++i) {
        check(cudaEventRecord(events[2 * i], nullptr), "cudaEventRecord");
        for (int j = 0; j < inner; ++j) launch();
        check(cudaEventRecord(events[2 * i + 1], nullptr), "cudaEventRecord");
    }
    check(cudaDeviceSynchronize(), "timed launches");
    std::vector<float> ms(repeats);
    for (int i = 0; i < repeats; ++i) {
        check(cudaEventElapsedTime(&ms[i], events[2 * i], events[2 * i + 1]), "cudaEventElapsedTime");
        ms[i] /= inner;
    }

    std::vector<char> out(size_t(m) * n * 2);
    check(cudaMemcpy(out.data(), d, out.size(), cudaMemcpyDeviceToHost), "cudaMemcpy(d)");
    FILE* f = std::fopen((dir + "/d.bin").c_str(), "wb");
    if (!f or std::fwrite(out.data(), 1, out.size(), f) != out.size()) fail(2, "cannot write " + dir + "/d.bin");
    std::fclose(f);

    std::printf("{\"ok\": true, \"m\": %u, \"n\": %u, \"k\": %u, \"groups\": %u, \"block_m\": %u, \"block_n\": %u, "
                "\"stages\": %u, \"multicast\": %u, \"smem_bytes\": %u, \"inner\": %d, \"ms\": [", m, n, k, groups,
                inst->block_m, inst->block_n, inst->stages, inst->multicast, inst->smem_bytes, inner);
    for (int i = 0; i < repeats; ++i) std::printf("%s%.6f", i ? ", " : "", ms[i]);
    std::printf("]}\n");
    return 0;
}
