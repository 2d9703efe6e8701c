// KV record quantize-scatter and gather-dequantize for the formats of kernels/formats.py.
//
// Formats (one record per token, little-endian; see kernels/formats.py for the full rules):
//   bf16        D bf16 values.
//   fp8_ds_mla  [(D-64) e4m3 | 64 bf16 | (D-64)/64 ue8m0 + zero pad]; a pool block of B tokens is
//               [B data parts | B scale parts] (vLLM's paged layout).
//   fp4_kv      [D/2 e2m1 pairs (even element = low nibble) | D/16 e4m3 scales].
//   fp4_index   [D/2 e2m1 pairs | D/32 ue8m0 scales].
// Numerics: amax ignores NaN and reads +-Inf as +-FLT_MAX; ue8m0 scale = 2^ceil(log2(max(amax,
// 1e-4)/qmax)); e4m3 scale = e4m3(max(amax/6, 2^-9)); codes = RNE(x/scale), saturating, sign kept;
// NaN -> e4m3 0x7F, or for e2m1 blocks a NaN scale byte (0x7F e4m3, 0xFF ue8m0).
//
// Launch: scatter_* and gather_*: grid = rows, block = 128 threads (4 warps). In a row, warp w
// takes scale groups w, w+4, ...; lane l owns elements 2l and 2l+1 of its group (group <= 64).
// Slots outside [0, capacity) are skipped (scatter) or read as zeros (gather): no host sync.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp4.h>
#include <cuda_fp8.h>

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

#define FLT_MAX_F 3.402823466e+38f
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

__device__ __forceinline__ void store_out(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_out(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store_out(__half* p, float v) { *p = __float2half_rn(v); }

__device__ __forceinline__ float clamp_finite(float v) {
    return v > FLT_MAX_F ? FLT_MAX_F : (v < -FLT_MAX_F ? -FLT_MAX_F : v);
}

__device__ __forceinline__ float nan_free_abs(float v) { return isnan(v) ? 0.0f : fabsf(v); }

__device__ __forceinline__ u16 bf16_bits(float v) {  // RNE, NaN -> 0x7FC0
    if (isnan(v)) return 0x7FC0;
    u32 u = __float_as_uint(v);
    return (u16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float bf16_value(u16 bits) { return __uint_as_float((u32)bits << 16); }

__device__ __forceinline__ u8 e4m3_encode(float y) {  // RNE, saturating, sign kept, NaN -> 0x7F
    if (isnan(y)) return 0x7F;
    return (u8)__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ float e4m3_value(u8 code) {
    __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)code, __NV_E4M3);
    return __half2float(__half(h));
}

__device__ __forceinline__ u8 e2m1_encode(float y) {  // RNE (ties to even code), saturating at 6
    float a = fabsf(y);
    int m = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
    return (u8)(m | ((__float_as_uint(y) >> 28) & 8u));
}

__device__ __forceinline__ float e2m1_value(u8 code) {
    __half_raw h = __nv_cvt_fp4_to_halfraw((__nv_fp4_storage_t)code, __NV_E2M1);
    return __half2float(__half(h));
}

__device__ __forceinline__ int ue8m0_exponent(float amax, float qmax) {  // exact ceil(log2(.))
    u32 u = __float_as_uint(fmaxf(amax, 1e-4f) / qmax);
    return (int)(u >> 23) - 127 + ((u & 0x7FFFFFu) ? 1 : 0);
}

__device__ __forceinline__ float pow2(int e) { return __uint_as_float((u32)(e + 127) << 23); }

__device__ __forceinline__ float ue8m0_value(u8 code) {
    if (code == 0xFF) return __uint_as_float(0x7FC00000u);
    if (code == 0) return __uint_as_float(0x00400000u);  // 2^-127
    return __uint_as_float((u32)code << 23);
}

__device__ __forceinline__ float warp_max(float v) {
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, off));
    return v;
}

// Byte offsets of a slot's data and scale parts (split_block: vLLM fp8_ds_mla block layout).
__device__ __forceinline__ void slot_offsets(long long slot, int block_size, int data_bytes,
                                             int scale_bytes, bool split_block,
                                             long long* data, long long* scales) {
    long long block = slot / block_size, pos = slot % block_size;
    long long base = block * block_size * (long long)(data_bytes + scale_bytes);
    if (split_block) {
        *data = base + pos * data_bytes;
        *scales = base + (long long)block_size * data_bytes + pos * scale_bytes;
    } else {
        *data = base + pos * (data_bytes + scale_bytes);
        *scales = *data + data_bytes;
    }
}

template <typename T>
__global__ void scatter_bf16(const T* __restrict__ x, const long long* __restrict__ slots,
                             u16* __restrict__ pool, int dim, long long capacity) {
    long long slot = slots[blockIdx.x];
    if (slot < 0 || slot >= capacity) return;
    const T* row = x + (long long)blockIdx.x * dim;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) pool[slot * dim + j] = bf16_bits(to_f32(row[j]));
}

template <typename T, int GROUP>
__global__ void scatter_fp8_ds_mla(const T* __restrict__ x, const long long* __restrict__ slots,
                                   u8* __restrict__ pool, int dim, int nope, int data_bytes,
                                   int scale_bytes, int block_size, long long capacity) {
    long long slot = slots[blockIdx.x];
    if (slot < 0 || slot >= capacity) return;
    long long data, scales;
    slot_offsets(slot, block_size, data_bytes, scale_bytes, true, &data, &scales);
    const T* row = x + (long long)blockIdx.x * dim;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
    for (int g = warp; g < nope / GROUP; g += num_warps) {
        int j = g * GROUP + 2 * lane;
        bool owns = 2 * lane < GROUP;
        float v0 = owns ? clamp_finite(to_f32(row[j])) : 0.0f;
        float v1 = owns ? clamp_finite(to_f32(row[j + 1])) : 0.0f;
        float amax = warp_max(fmaxf(nan_free_abs(v0), nan_free_abs(v1)));
        int e = ue8m0_exponent(amax, 448.0f);
        float inv_scale = pow2(-e);
        if (owns) {
            pool[data + j] = e4m3_encode(v0 * inv_scale);
            pool[data + j + 1] = e4m3_encode(v1 * inv_scale);
        }
        if (lane == 0) pool[scales + g] = (u8)(e + 127);
    }
    for (int g = nope / GROUP + threadIdx.x; g < scale_bytes; g += blockDim.x) pool[scales + g] = 0;
    u16* rope = reinterpret_cast<u16*>(pool + data + nope);  // data + nope is even
    for (int j = nope + threadIdx.x; j < dim; j += blockDim.x) rope[j - nope] = bf16_bits(to_f32(row[j]));
}

template <typename T, int GROUP, bool UE8M0>
__global__ void scatter_fp4(const T* __restrict__ x, const long long* __restrict__ slots,
                            u8* __restrict__ pool, int dim, int block_size, long long capacity) {
    long long slot = slots[blockIdx.x];
    if (slot < 0 || slot >= capacity) return;
    long long data, scales;
    slot_offsets(slot, block_size, dim / 2, dim / GROUP, false, &data, &scales);
    const T* row = x + (long long)blockIdx.x * dim;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
    for (int g = warp; g < dim / GROUP; g += num_warps) {
        int j = g * GROUP + 2 * lane;
        bool owns = 2 * lane < GROUP;
        float v0 = owns ? clamp_finite(to_f32(row[j])) : 0.0f;
        float v1 = owns ? clamp_finite(to_f32(row[j + 1])) : 0.0f;
        bool has_nan = __any_sync(FULL_MASK, isnan(v0) || isnan(v1));
        float amax = warp_max(fmaxf(nan_free_abs(v0), nan_free_abs(v1)));
        float scale;
        u8 code;
        if (UE8M0) {
            int e = ue8m0_exponent(amax, 6.0f);
            scale = pow2(e);
            code = has_nan ? (u8)0xFF : (u8)(e + 127);
        } else {
            code = e4m3_encode(fmaxf(amax / 6.0f, 0.001953125f));  // floor 2^-9
            scale = e4m3_value(code);
            code = has_nan ? (u8)0x7F : code;
        }
        if (owns) {
            u8 lo = e2m1_encode(isnan(v0) ? 0.0f : v0 / scale);
            u8 hi = e2m1_encode(isnan(v1) ? 0.0f : v1 / scale);
            pool[data + j / 2] = (u8)(lo | (hi << 4));
        }
        if (lane == 0) pool[scales + g] = code;
    }
}

template <typename OutT>
__global__ void gather_bf16(const u16* __restrict__ pool, const long long* __restrict__ slots,
                            OutT* __restrict__ out, int dim, long long capacity) {
    long long slot = slots[blockIdx.x];
    bool valid = slot >= 0 && slot < capacity;
    OutT* row = out + (long long)blockIdx.x * dim;
    for (int j = threadIdx.x; j < dim; j += blockDim.x)
        store_out(row + j, valid ? bf16_value(pool[slot * dim + j]) : 0.0f);
}

template <typename OutT, int GROUP>
__global__ void gather_fp8_ds_mla(const u8* __restrict__ pool, const long long* __restrict__ slots,
                                  OutT* __restrict__ out, int dim, int nope, int data_bytes,
                                  int scale_bytes, int block_size, long long capacity) {
    long long slot = slots[blockIdx.x];
    OutT* row = out + (long long)blockIdx.x * dim;
    if (slot < 0 || slot >= capacity) {
        for (int j = threadIdx.x; j < dim; j += blockDim.x) store_out(row + j, 0.0f);
        return;
    }
    long long data, scales;
    slot_offsets(slot, block_size, data_bytes, scale_bytes, true, &data, &scales);
    const u16* rope = reinterpret_cast<const u16*>(pool + data + nope);
    for (int j = threadIdx.x; j < dim; j += blockDim.x) {
        float v = j < nope ? e4m3_value(pool[data + j]) * ue8m0_value(pool[scales + j / GROUP])
                           : bf16_value(rope[j - nope]);
        store_out(row + j, v);
    }
}

template <typename OutT, int GROUP, bool UE8M0>
__global__ void gather_fp4(const u8* __restrict__ pool, const long long* __restrict__ slots,
                           OutT* __restrict__ out, int dim, int block_size, long long capacity) {
    long long slot = slots[blockIdx.x];
    OutT* row = out + (long long)blockIdx.x * dim;
    if (slot < 0 || slot >= capacity) {
        for (int j = threadIdx.x; j < dim; j += blockDim.x) store_out(row + j, 0.0f);
        return;
    }
    long long data, scales;
    slot_offsets(slot, block_size, dim / 2, dim / GROUP, false, &data, &scales);
    for (int j = threadIdx.x; j < dim; j += blockDim.x) {
        u8 code = pool[scales + j / GROUP];
        float scale = UE8M0 ? ue8m0_value(code) : e4m3_value(code);
        u8 byte = pool[data + j / 2];
        store_out(row + j, e2m1_value((j & 1) ? (byte >> 4) : (byte & 15)) * scale);
    }
}
