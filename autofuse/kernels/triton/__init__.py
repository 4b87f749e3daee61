"""The Triton backend (Pallas `pallas_call` with `triton.CompilerParams`): one `lower` per template.

`tiles.py` holds what the lowerings share: the tile evaluator with masked loads
and stores, the launch wrapper and the kernel names.
"""
