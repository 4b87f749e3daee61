"""Issue 19 on whole bf16 models: a plan tuned at one shape serves another (`autofuse.jit`'s one check there holds the
whole program to the bound the tuning job's validation held it to), and the GPU benchmark's CPU smoke run."""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import autofuse
from autofuse.device import device_info, software
from autofuse.graph import capture, qualified_name
from autofuse.kernels import TEMPLATES
from autofuse.plan import plan_from_choices
from autofuse.runner.measure import compare
from autofuse.store import PlanStore
from autofuse.tuning.partition import enumerate_candidates
from autofuse.tuning.select import Option, select_cover
from examples import gpt2
from tests.stored_plans import save_plan_here

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = gpt2.Config(vocab=512, d_model=256, n_layers=4, max_seq=64)  # sequence below the position table's size: one structure


def _inputs(batch: int, seq: int) -> tuple:
    return gpt2.make_inputs(CFG, batch, seq, dtype=jnp.bfloat16)


def _save_attention_plan(url: str, batch: int, seq: int) -> int:
    """A plan fusing every attention of the bf16 GPT-2 at (batch, seq) in 32x32 blocks, stored as the current plan of
    its program; its id."""
    graph = capture(gpt2.forward, *jax.eval_shape(lambda: _inputs(batch, seq)))
    cands = [c for c in enumerate_candidates(graph) if c.template == "attention"]
    chosen = select_cover(graph, [Option(c.nodes, -float(len(c.nodes)), c, c.stages) for c in cands], {})
    config = {**TEMPLATES["attention"].default_config(chosen[0].label.spec), "block_q": 32, "block_k": 32}  # fits 32 to 64 positions
    plan = plan_from_choices(graph, [(o.label.group, "attention", config) for o in chosen],
                             {"measure": "model"})
    assert len(plan.groups) == CFG.n_layers
    store, dev = PlanStore(url), device_info()
    pid = store.program(graph.fingerprint, "gpt2", graph.signature(), len(graph.nodes), function=qualified_name(gpt2.forward),
                        structure=graph.structure)
    did = store.device(dev["name"], compute_capability=dev["compute_capability"], sm_count=dev["sm_count"], memory_bytes=dev["memory_bytes"])
    return store.save_plan(pid, did, store.software(**software()), plan.to_dict(), measured_ms=1.0, baseline_ms=1.5, speedup=1.5,
                           measure="model", tolerance={}, max_error=0.0)


@pytest.mark.slow
def test_bf16_model_plan_serves_another_shape_within_its_rounding_spread(tmp_path) -> None:
    """A bf16 GPT-2 with its attention fused rounds differently from jax.jit by more than one bf16 operation's bound
    (2e-2) on the N(0, 1) inputs of the check, as the tuning job's validation knows (it holds a whole program to
    jax.jit's own rounding spread there). The check at a shape not tuned exactly held it to 2e-2 and refused every
    such shape of a whole bf16 model; it now uses the same bound as the job's validation."""
    url = f"sqlite:///{tmp_path}/plans.db"
    plan_id = _save_attention_plan(url, 2, 32)
    f = autofuse.jit(gpt2.forward, store=url)
    for batch, seq in ((4, 32), (1, 48)):
        args = _inputs(batch, seq)
        out = f(*args)
        assert f.last_status.startswith(f"plan (tuned at i32[2,32], i32[2,32], serving i32[{batch},{seq}], i32[{batch},{seq}]): "
                                        f"{CFG.n_layers} fused groups (attention×{CFG.n_layers}), plan {plan_id}, checked"), f.last_status
        ok, _, why = compare(out, jax.jit(gpt2.forward)(*args))  # on the model's own 0.02-scaled weights: bf16's bound holds
        assert ok, why


@pytest.mark.slow
def test_benchmark_small_smoke_run(tmp_path) -> None:
    """`python -m benchmarks.shape_serving --small --gpus 0,1`: one process tunes the base shape and serves one shape
    from its plan, the other tunes its shape exactly first, then serves it from the same base store; each exact plan
    timed against its served one; the parts merged into one table."""
    out = tmp_path / "out" / "shape_serving.md"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.shape_serving", "--models", "gpt2", "--small", "--gpus", "0,1",
                           "--shapes", "4x8,1x24", "--trials", "2", "--out", str(out), "--workdir", str(tmp_path / "work")],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]  # 1: a ratio below 0.90 (CPU times mean nothing)
    table = out.read_text()
    assert "- card: cpu" in table and "| gpt2 | B2 S16 | plan: 2 fused groups" in table, table
    for shape, gpu in (("4,8", "1"), ("1,24", "0")):
        (row,) = [line for line in table.splitlines() if line.startswith(f"| gpt2 | B{shape.split(',')[0]} S{shape.split(',')[1]} |")]
        cells = [c.strip() for c in row.split("|")]
        assert cells[3].startswith(f"plan (tuned at i32[2,16], i32[2,16], serving i32[{shape}], i32[{shape}])"), row
        assert float(cells[5]) < 1e-4, row  # the served plan's error on the model's weights (float32)
        assert cells[-3] in ("pass", "FAIL") and cells[-2] == gpu, row  # an exact job run and timed against the served plan
    assert sorted(os.listdir(out.parent)) == ["shape_serving.md", "shape_serving.md.json"]  # stores and parts in --workdir


def _save_llama_step_plan(url: str, batch: int, seq: int) -> int:
    """A plan of the bf16 Llama blocks' training step at (batch, seq) with every attention's forward and backward
    fused (the flash pair, 16x16 tiles), stored as made with another jax (so that a lookup re-verifies it); its id."""
    from examples import llama

    graph = capture(llama.grad_step, *jax.eval_shape(lambda: llama.make_inputs(llama.SMALL, batch, seq, dtype=jnp.bfloat16)))
    cands = [c for c in enumerate_candidates(graph) if c.template == "attention_vjp"]
    config = {**TEMPLATES["attention_vjp"].default_config(cands[0].spec), "block_q": 16, "block_k": 16, "bwd_held": 16, "bwd_step": 16}
    plan = plan_from_choices(graph, [(c.group, "attention_vjp", config, c.stages) for c in cands], {"measure": "model"})
    assert len(plan.groups) == llama.SMALL.n_layers
    return save_plan_here(PlanStore(url), graph, "llama_step", plan.to_dict(), sw={**software(), "jax": "0.0.1"},
                          function=qualified_name(llama.grad_step), structure=graph.structure)


@pytest.mark.slow
def test_training_step_plan_is_reverified_at_the_callers_arrays(tmp_path, monkeypatch) -> None:
    """A bf16 training step on N(0, 1) inputs is chaotic (jax.jit's own gradients move by ~100% when the inputs move
    by one rounding step), so `autofuse.jit`'s re-verification of a plan made with other software cannot decide on
    random inputs alone. Called with arrays, the chaotic outputs are judged at the call's own arguments, as the
    tuning job judges them at the caller's inputs: the right plan serves, one whose backward doubles dQ does not.
    Traced under another transformation (tracers, no arrays) the check is undecided and plain jax.jit runs."""
    from autofuse.kernels.triton import attention_bwd
    from examples import llama

    url = f"sqlite:///{tmp_path}/plans.db"
    plan_id = _save_llama_step_plan(url, 2, 32)
    args = llama.make_inputs(llama.SMALL, 2, 32, dtype=jnp.bfloat16, seed=3)
    want = jax.jit(llama.grad_step)(*args)

    traced = autofuse.jit(llama.grad_step, store=url)
    jax.jit(lambda *a: traced(*a))(*args)  # the arguments are tracers of the enclosing jit
    assert "undecided" in traced.last_status and "call it with arrays" in traced.last_status, traced.last_status

    f = autofuse.jit(llama.grad_step, store=url)
    got = f(*args)
    assert f"plan {plan_id}" in f.last_status and not f.last_status.startswith("xla"), f.last_status
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert compare(a, b)[0]

    lower = attention_bwd.lower

    def doubled_dq(*a, **kw):
        bwd = lower(*a, **kw)
        return lambda *x: (lambda dq, dk, dv: (2 * dq, dk, dv))(*bwd(*x))

    monkeypatch.setattr(attention_bwd, "lower", doubled_dq)
    g = autofuse.jit(llama.grad_step, store=url)
    g(*args)
    assert "failed re-verification" in g.last_status and "undecided" not in g.last_status, g.last_status
