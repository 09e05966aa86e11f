"""Pallas Mosaic GPU kernels of UniEP-JAX: the bottom layer (imports nothing from
`uniep_jax`). One kernel per module, each opening with its tiling, buffers and
synchronisation contract (SYNC.md collects the communicating ones):

  grouped_gemm      the grouped GEMM (forward, dgrad, wgrad) and the SwiGLU expert FFN
                    with its VJP; owns `KernelConfig`
  fp8               e4m3 quantisation with power-of-two block scales (its XLA form)
  fp8_quantise      the quantisation kernels: rows, and weights in both layouts
  fp8_gemm          the FP8 grouped GEMM (forward, dgrad) and the FP8 SwiGLU FFN;
                    owns `Fp8Config`
  ep_transfer       row segments pushed over NVLink into peers' buffers; owns
                    `TransferConfig`
  row_gather        rows gathered by index into consecutive rows (live rows only)
  down_gemm_return  the down GEMM with the return of finished chunks beside it
  wgrad_return      the dX return transfer beside the dw_gate_up wgrad
  tma               TMA copy loops and the ragged store ladder shared by them
  ragged            index arithmetic on ragged runs shared by every work list
  device            device facts (SM count, shared memory, peak rates)
"""
