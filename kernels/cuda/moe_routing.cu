// MoE routing and expert permutation (semantics: kernels/reference.py route / permute).
//
// route_topk<PER_LANE>: one warp per token; lane l holds experts l, l+32, ... (E <= 32*PER_LANE).
//   s = sqrt(softplus(x)) (softplus = x if x > 20 else log1p(exp(x))), key = s + bias, NaN key ->
//   -inf. top_k rounds of a warp arg-max (larger key wins, equal keys: lower expert id wins).
//   weights = s_j / (s_0 + ... + s_{k-1} + 1e-20) * scaling, summed in order by lane 0.
//   grid = ceil(T / 4), block = 128.
// route_hash: ids = tid2eid[token_ids[t]] (int32 table), same weights; one thread per token;
//   a token id outside [0, vocab) gets ids -1 and weights 0.
// permute_count (atomics into zeroed counts; ids outside [0, E) are dropped), permute_offsets (1 thread: exclusive scan), then
// permute_scatter: one 256-thread block per expert walks all flat slots in order and places its
// slots with a ballot prefix sum, so the order within an expert is ascending (stable).
#include <cuda_fp16.h>

#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float router_score(float x) {
    float sp = x > 20.0f ? x : log1pf(expf(x));
    return sqrtf(sp);
}

// True when (ka, ia) ranks before (kb, ib).
__device__ __forceinline__ bool ranks_before(float ka, int ia, float kb, int ib) {
    return ka > kb || (ka == kb && ia < ib);
}

template <int PER_LANE>
__global__ void route_topk(const float* __restrict__ logits, const float* __restrict__ bias,
                           int num_tokens, int num_experts, int top_k, float scaling,
                           float* __restrict__ weights, int* __restrict__ ids) {
    int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (t >= num_tokens) return;
    float s[PER_LANE], key[PER_LANE];
    const float* row = logits + (long long)t * num_experts;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        int e = lane + 32 * i;
        s[i] = e < num_experts ? router_score(row[e]) : 0.0f;
        float k = s[i] + (bias != nullptr && e < num_experts ? bias[e] : 0.0f);
        key[i] = isnan(k) ? NEG_INF : k;
    }
    unsigned taken = 0;  // bit i: expert lane + 32 * i already chosen
    for (int r = 0; r < top_k; ++r) {
        float best_key = NEG_INF, best_s = 0.0f;
        int best_id = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            int e = lane + 32 * i;
            if (e < num_experts && !(taken >> i & 1u) && ranks_before(key[i], e, best_key, best_id)) {
                best_key = key[i]; best_id = e; best_s = s[i];
            }
        }
        for (int off = 16; off > 0; off >>= 1) {
            float ok = __shfl_xor_sync(FULL_MASK, best_key, off);
            int oi = __shfl_xor_sync(FULL_MASK, best_id, off);
            float os = __shfl_xor_sync(FULL_MASK, best_s, off);
            if (ranks_before(ok, oi, best_key, best_id)) { best_key = ok; best_id = oi; best_s = os; }
        }
        if (best_id % 32 == lane) taken |= 1u << (best_id / 32);
        if (lane == 0) {
            ids[(long long)t * top_k + r] = best_id;
            weights[(long long)t * top_k + r] = best_s;  // raw score; normalised below
        }
    }
    if (lane == 0) {
        float* w = weights + (long long)t * top_k;
        float denom = w[0];
        for (int j = 1; j < top_k; ++j) denom = denom + w[j];
        denom = denom + 1e-20f;
        for (int j = 0; j < top_k; ++j) w[j] = w[j] / denom * scaling;
    }
}

__global__ void route_hash(const float* __restrict__ logits, const long long* __restrict__ token_ids,
                           const int* __restrict__ tid2eid, long long vocab, int num_tokens,
                           int num_experts, int top_k, float scaling, float* __restrict__ weights,
                           int* __restrict__ ids) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= num_tokens) return;
    if (token_ids[t] < 0 || token_ids[t] >= vocab) {  // invalid token: ids -1, weights 0
        for (int j = 0; j < top_k; ++j) {
            ids[(long long)t * top_k + j] = -1;
            weights[(long long)t * top_k + j] = 0.0f;
        }
        return;
    }
    const int* choice = tid2eid + token_ids[t] * top_k;
    const float* row = logits + (long long)t * num_experts;
    float* w = weights + (long long)t * top_k;
    float denom = 0.0f;
    for (int j = 0; j < top_k; ++j) {
        ids[(long long)t * top_k + j] = choice[j];
        w[j] = router_score(row[choice[j]]);
        denom = j == 0 ? w[0] : denom + w[j];
    }
    denom = denom + 1e-20f;
    for (int j = 0; j < top_k; ++j) w[j] = w[j] / denom * scaling;
}

// Ids outside [0, num_experts) are not counted (no host-side check on the GPU path).
__global__ void permute_count(const int* __restrict__ expert_ids, int n, int num_experts,
                              int* __restrict__ counts) {
    for (int f = blockIdx.x * blockDim.x + threadIdx.x; f < n; f += gridDim.x * blockDim.x) {
        int e = expert_ids[f];
        if (e >= 0 && e < num_experts) atomicAdd(counts + e, 1);
    }
}

__global__ void permute_offsets(const int* __restrict__ counts, int num_experts, int* __restrict__ offsets) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    offsets[0] = 0;
    for (int e = 0; e < num_experts; ++e) offsets[e + 1] = offsets[e] + counts[e];
}

// blockDim.x must be 256.
__global__ void permute_scatter(const int* __restrict__ expert_ids, int n, const int* __restrict__ offsets,
                                int* __restrict__ order, int* __restrict__ inverse) {
    __shared__ int warp_totals[8];
    __shared__ int running;
    int e = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0) running = offsets[e];
    __syncthreads();
    for (int start = 0; start < n; start += 256) {
        int f = start + threadIdx.x;
        bool mine = f < n && expert_ids[f] == e;
        unsigned ballot = __ballot_sync(FULL_MASK, mine);
        if (lane == 0) warp_totals[warp] = __popc(ballot);
        __syncthreads();
        int before = running;
        for (int w = 0; w < warp; ++w) before += warp_totals[w];
        before += __popc(ballot & ((1u << lane) - 1u));
        if (mine) {
            order[before] = f;
            inverse[f] = before;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int total = 0;
            for (int w = 0; w < 8; ++w) total += warp_totals[w];
            running += total;
        }
        __syncthreads();
    }
}
