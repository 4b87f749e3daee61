"""Lowerings that are XLA's own operations on a changed layout (no Pallas kernel): `aligned_dot`'s padded GEMM,
`concat_sink`'s readers of a concatenation on its parts."""
