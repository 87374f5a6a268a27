# Pulls the tensor-core attention kernels (and the helpers they share with nothing else) out of
# src/backend/cuda/attention.cu for the host emulator emu.cpp. usage: extract.py ATTENTION_CU OUT_INC
import sys
s = open(sys.argv[1]).read()


def func(name_sig):
    i = s.index(name_sig)
    t = s.rfind("template", 0, i)  # back up to the template line
    j = s.index("\n}\n", i) + 3
    return s[t:j]


parts = []
a = s.index("#define MMA_MT")
parts.append(s[a:s.index("template <typename T> struct MmaOp;", a)])
parts.append(func("static __device__ __forceinline__ void load_a_frags"))
parts.append(func("static __device__ __forceinline__ void store_rows"))
a = s.index("template <bool B> struct MmaMasked")
b = s.index("template <typename T, int HS>\nstatic dg_status_t delta_mma_launch")
k = s[a:b].replace("extern __shared__ __align__(16) unsigned char mma_smem[];", "unsigned char *mma_smem = g_dyn_smem;")
parts.append(k)
open(sys.argv[2], "w").write("\n".join(parts))
