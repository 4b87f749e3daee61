"""The Mosaic GPU backend (Hopper: TMA, wgmma, warp specialisation): one lowering module per template (`matmul`,
`matmul_reduce`, `attention`), each with `lower`, `PARAMS`, `default_config`, `check_group` and `check`; what they
share is in `gemm.py` (operands, swizzles, shared memory) and `tiles.py` (the group's jaxpr on register tiles).
Their parameter choices are in `search_spaces/<template>.mosaic_gpu.toml`."""
