"""Column names of the compiled CPU step's program tables (kernels/cpu_step_plan.py writes them,
kernels/cpu_step.py and cpu_step_moe.py read them).

`layer` is an int64 table, one row per decoder layer: array indices into the step's typed lists
(`arrays` = (f1, f2, f3, u2, u3, i2, h2, h3): fp32 vectors, fp32 matrices, fp32 stacks, byte
matrices, byte stacks, int32 matrices, bf16 matrices and bf16 stacks as uint16 bits), descriptor
rows of kernels/cpu_step_linear.py (`lin` for plain and `grp` for grouped products; the LM head
is a `lin` row), sizes and flags.
`layer_f` holds the float parameters; `step` (one int64 row) and `step_f` the step's own.
-1 marks an absent array or product.
"""
from __future__ import annotations

# ---- layer: int64 columns ---------------------------------------------------------------------
_LAYER = (
    # mHC sites and the block norms
    "HC_A_FN", "HC_A_BASE", "HC_A_SCALE", "ATTN_NORM", "HC_F_FN", "HC_F_BASE", "HC_F_SCALE", "FFN_NORM",
    # attention: kind (SWA / CSA / HCA), ratio m and its slot in the step's per-ratio tables, RoPE table
    "KIND", "RATIO", "RATIO_SLOT", "ROPE",
    # x → packed projections: up to 7 products (lin rows); each member's (product, first column)
    "X_COUNT", "X_0", "X_1", "X_2", "X_3", "X_4", "X_5", "X_6",
    "Q_LORA_P", "Q_LORA_C", "KV_P", "KV_C", "COMP_C_P", "COMP_C_C", "COMP_Z_P", "COMP_Z_C",
    "IDX_C_P", "IDX_C_C", "IDX_Z_P", "IDX_Z_C", "IDX_W_P", "IDX_W_C",
    "Q_NORM", "KV_NORM", "Q_LORA", "HEADS", "HEAD_DIM",
    # q_res → queries: wq_b alone, or (indexed shapes) packed with the indexer's wq_b
    "WQ_B", "INDEXED", "QI_COUNT", "QI_0", "QI_1", "Q_P", "Q_C", "IQ_P", "IQ_C",
    "SINK", "WINDOW",
    # the attention's compressor, then the indexer's (its entries are the index keys)
    "C_APE", "C_NORM", "C_STATE", "C_ENTRIES", "C_WIDTH", "C_DIM", "C_OVERLAP", "C_SPAN_SLOT",
    "I_APE", "I_NORM", "I_STATE", "I_KEYS", "I_KEY_RECORDS", "I_KEYS_PER_BLOCK", "I_WIDTH", "I_SPAN_SLOT",
    "I_HEADS", "I_DIM", "I_TOPK",
    # output projections
    "WO_A", "WO_GROUPS", "WO_B",
    # MoE: router, routed stacks (grp rows), shared expert ([w1 | w3] as 1-2 products, w2)
    "GATE", "GATE_PER", "BIAS", "TID2EID", "W13", "W2", "SH_COUNT", "SH_0", "SH_1", "SH_W2", "TOPK", "EXPERTS",
    "INTER", "FUSED_ROWS",
)
(HC_A_FN, HC_A_BASE, HC_A_SCALE, ATTN_NORM, HC_F_FN, HC_F_BASE, HC_F_SCALE, FFN_NORM,
 KIND, RATIO, RATIO_SLOT, ROPE,
 X_COUNT, X_0, X_1, X_2, X_3, X_4, X_5, X_6,
 Q_LORA_P, Q_LORA_C, KV_P, KV_C, COMP_C_P, COMP_C_C, COMP_Z_P, COMP_Z_C,
 IDX_C_P, IDX_C_C, IDX_Z_P, IDX_Z_C, IDX_W_P, IDX_W_C,
 Q_NORM, KV_NORM, Q_LORA, HEADS, HEAD_DIM,
 WQ_B, INDEXED, QI_COUNT, QI_0, QI_1, Q_P, Q_C, IQ_P, IQ_C,
 SINK, WINDOW,
 C_APE, C_NORM, C_STATE, C_ENTRIES, C_WIDTH, C_DIM, C_OVERLAP, C_SPAN_SLOT,
 I_APE, I_NORM, I_STATE, I_KEYS, I_KEY_RECORDS, I_KEYS_PER_BLOCK, I_WIDTH, I_SPAN_SLOT,
 I_HEADS, I_DIM, I_TOPK,
 WO_A, WO_GROUPS, WO_B,
 GATE, GATE_PER, BIAS, TID2EID, W13, W2, SH_COUNT, SH_0, SH_1, SH_W2, TOPK, EXPERTS,
 INTER, FUSED_ROWS) = range(len(_LAYER))
LAYER_COLUMNS = len(_LAYER)
LAYER_NAMES = _LAYER

SWA, CSA, HCA = 0, 1, 2
ROPE_MAIN, ROPE_COMPRESS = 0, 1

# ---- layer_f: float64 columns ------------------------------------------------------------------
(EPS, HC_EPS, C_EPS, I_EPS, SCALING, LIMIT_ROUTED, LIMIT_SHARED, ATTN_SCALE, INDEX_SCALE,
 INDEX_WEIGHT_SCALE) = range(10)
LAYER_F_COLUMNS = 10

# ---- step: int64 columns ----------------------------------------------------------------------
_STEP = ("SEQS", "Q", "HC", "HIDDEN", "WINDOW_LEN", "BLOCK", "ITERS", "LANES", "CHUNK", "SOFTPLUS_CHUNK", "TORCH_THREADS", "THREADS",
         "MAX_CONTEXT", "VOCAB", "EMBED", "HEAD_FN", "HEAD_BASE", "HEAD_SCALE", "NORM", "HEAD",
         "MAIN_COS", "MAIN_SIN", "COMP_COS", "COMP_SIN", "RATIOS", "SPANS")
(SEQS, Q, HC, HIDDEN, WINDOW_LEN, BLOCK, ITERS, LANES, CHUNK, SOFTPLUS_CHUNK, TORCH_THREADS, THREADS,
 MAX_CONTEXT, VOCAB, EMBED, HEAD_FN, HEAD_BASE, HEAD_SCALE, NORM, HEAD,
 MAIN_COS, MAIN_SIN, COMP_COS, COMP_SIN, RATIOS, SPANS) = range(len(_STEP))
STEP_COLUMNS = len(_STEP)
# ratio slot r: step_ratios[r] = (m, visible entry columns); span slot s: step_spans[s] = span

# ---- step_f: float64 columns --------------------------------------------------------------------
(S_EPS, S_HC_EPS) = range(2)
STEP_F_COLUMNS = 2

# ---- status codes of a step (0: done) ---------------------------------------------------------------
OK, BAD_TOKEN, BAD_SLOT, BAD_KEYS, BAD_HASH_TOKEN, BAD_EXPERT, BAD_ENDS = range(7)
