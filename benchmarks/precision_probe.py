"""What precision XLA's float32 dots run at under JAX's defaults (issue 31, item 3): a float32 matmul and a float32
attention's score matmul under `jax.jit` at default precision, at `precision=HIGHEST`, and with
`jax.default_matmul_precision("tensorfloat32")`, each against a float64 product on the host.

    python -m benchmarks profile precision

A relative error near 1e-3 is TF32 (10-bit mantissa), near 1e-6 is float32 (or three-pass TF32).
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np


def rel_error(got: jax.Array, want: np.ndarray) -> float:
    got = np.asarray(got, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)  # --help
    key = jax.random.PRNGKey(0)
    a = jax.random.normal(jax.random.fold_in(key, 1), (2048, 1024), jnp.float32)
    b = jax.random.normal(jax.random.fold_in(key, 2), (1024, 2048), jnp.float32)
    want = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    q = jax.random.normal(jax.random.fold_in(key, 3), (2, 512, 4, 64), jnp.float32)
    k = jax.random.normal(jax.random.fold_in(key, 4), (2, 512, 4, 64), jnp.float32)
    want_s = np.einsum("bqhd,bkhd->bhqk", np.asarray(q, np.float64), np.asarray(k, np.float64))
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, jax_default_matmul_precision="
          f"{jax.config.jax_default_matmul_precision!r}")
    cases = {
        "default": (lambda x, y: x @ y, lambda x, y: jnp.einsum("bqhd,bkhd->bhqk", x, y)),
        "HIGHEST": (lambda x, y: jnp.matmul(x, y, precision=jax.lax.Precision.HIGHEST),
                    lambda x, y: jnp.einsum("bqhd,bkhd->bhqk", x, y, precision=jax.lax.Precision.HIGHEST)),
    }
    for name, (mm, sc) in cases.items():
        print(f"{name:28} matmul rel error {rel_error(jax.jit(mm)(a, b), want):.2e}   scores rel error "
              f"{rel_error(jax.jit(sc)(q, k), want_s):.2e}")
    with jax.default_matmul_precision("tensorfloat32"):
        mm, sc = cases["default"]
        print(f"{'default_matmul_precision tf32':28} matmul rel error {rel_error(jax.jit(mm)(a, b), want):.2e}   scores rel error "
              f"{rel_error(jax.jit(sc)(q, k), want_s):.2e}")
    hlo = jax.jit(cases["default"][0]).lower(a, b).compile().as_text()
    print("default dot in the compiled HLO:", next((ln.strip()[:200] for ln in hlo.splitlines() if "custom_call_target" in ln or " dot(" in ln), "?"))


if __name__ == "__main__":
    main()
