"""Deploy time: what a traced signature of `autofuse.jit` runs, decided apart from the face (`autofuse.api`).

`resolve` (in `lookup`) finds the plan: given, the store's for this device and software, or one of the same
structure tuned at other sizes; `serve` builds it, re-verifies it where it was made elsewhere, and applies the miss
policy, which may start a background tuning job (`background`: a process, never an import of the tuner). `stores`
opens the plan store read-only and records what a trace learned; `traces` tells which signature a call ran.
Nothing here imports `autofuse.tuning`, scipy or Optuna. This file imports nothing: a background job's process
imports `background` before it lowers its priority, so that JAX and the tuner load at the lowered one.
"""
