# Pulls implementation 2 of the tensor-core attention (and the two impl-1 helpers it uses) out of
# src/backend/cuda/attention.cu for the host emulator emu.cpp. usage: extract.py ATTENTION_CU OUT_INC
import sys
s=open(sys.argv[1]).read()
def func(name_sig):
    i=s.index(name_sig)
    # back up to the template line
    t=s.rfind("template", 0, i)
    j=s.index("\n}\n", i)+3
    return s[t:j]
parts=[]
parts.append(func("static __device__ __forceinline__ void load_a_frags"))
parts.append(func("static __device__ __forceinline__ void store_rows"))
a=s.index("/* ======================= tensor-core kernels, implementation 2")
b=s.index("template <typename T, int HS>\nstatic dg_status_t delta2_launch")
k=s[a:b]
k=k.replace("extern __shared__ __align__(16) unsigned char a2_smem[];","unsigned char *a2_smem = g_dyn_smem;")
parts.append(k)
open(sys.argv[2],'w').write("\n".join(parts))
