"""`python -m benchmarks`: the suites' entry lists every suite, and every suite and part answers --help without a GPU
(the benchmarks run on a GPU machine later; a part that no longer imports must fail here, not there)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import autofuse
from benchmarks.__main__ import SUITES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _help(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "benchmarks", *args, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"), check=False)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


def test_the_entry_lists_every_suite_one_line_each() -> None:
    listed = _help().split("suites:\n", 1)[1].splitlines()
    assert [line.split()[0] for line in listed] == list(SUITES) == ["models", "kernels", "suite", "workers", "deploy", "profile"]


@pytest.mark.parametrize("suite", list(SUITES))
def test_a_suite_lists_its_parts_and_their_modules(suite: str) -> None:
    text = _help(suite)
    for name, part in SUITES[suite][1].items():
        assert f"  {name} " in text and f"({part.module})" in text, text
        assert os.path.exists(os.path.join(ROOT, *part.module.split(".")) + ".py")


#: Every part's --help, asked in one process as `python -m benchmarks SUITE PART --help` would (one process per part
#: imported jax 20 times: 38 s of the suite on the 2-core machine); a JSON {"suite part": [exit code, stdout]} on stdout.
_ALL_HELPS = """
import contextlib, io, json, sys
from benchmarks.__main__ import SUITES, main
out = {}
for suite, (_, parts) in SUITES.items():
    for part in parts:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            try:
                code = main([suite, part, "--help"])
            except SystemExit as e:
                code = e.code
        out[f"{suite} {part}"] = [code, buf.getvalue()]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def part_helps() -> dict:
    import json

    out = subprocess.run([sys.executable, "-c", _ALL_HELPS], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"), check=False)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize(("suite", "part"), [(s, p) for s, (_, parts) in SUITES.items() for p in parts])
def test_every_part_answers_help_under_the_entrys_name(part_helps: dict, suite: str, part: str) -> None:
    code, text = part_helps[f"{suite} {part}"]
    assert code in (0, None) and text.startswith(f"usage: python -m benchmarks {suite} {part} "), text[:500]


def test_an_unknown_suite_is_an_error_that_lists_the_suites() -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks", "nope"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=ROOT), check=False)
    assert out.returncode == 2 and "no suite 'nope'" in out.stderr and "deploy" in out.stderr


def test_the_docs_page_lists_every_suite_and_part() -> None:
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
        page = f.read()
    for suite, (_, parts) in SUITES.items():
        assert f"| `{suite}` |" in page
        for name, part in parts.items():
            assert f"| `{name}` | `{part.module.replace('.', '/')}.py` |" in page


@pytest.mark.slow  # a benchmark's smoke run, not the quick subset's
def test_the_unaligned_gemm_table_has_each_gemm_with_xlas_own_layouts(capsys) -> None:
    """`kernels unaligned-gemm` at a CPU-sized vocabulary: a row per GEMM, each timed with row-major operands, with
    the layouts XLA chooses for the step's intermediates (and which it chose), and padded; then the gradient's GEMM
    with its producer: the parts alone and both in one program."""
    from benchmarks import unaligned_gemm

    unaligned_gemm.main(["--rows", "64", "--width", "32", "--vocab", "101", "--padded", "104"])
    out = capsys.readouterr().out.splitlines()
    names = ["| dx = dlogits @ W", "| dW = dlogits^T @ X", "| logits = X @ W^T"]
    rows = [line for line in out if line.split(" | ")[0] in names]
    assert [r.split(" | ")[0] for r in rows] == names
    (fused,) = [line for line in out if line.startswith("| exp(logits - lse)")]  # the dot with its producer
    assert fused.count(" ms ") == 4
    assert all(r.count(" ms ") == 3 and re.search(r"\(\d, \d\); \(\d, \d\); \(\d, \d\)\)", r) for r in rows)  # 3 timings; the layouts


def test_the_composition_profiles_alone_savings_sum_each_groups_instances() -> None:
    """`profile composition`'s saving alone per distinct group of a plan: what one instance saved (XLA - best) times
    the plan's instances of it; 0 where the job's candidate did not measure both (or a plan read from a file)."""
    from types import SimpleNamespace as NS

    from autofuse.plan import FusedGroup, Plan
    from benchmarks.composition import alone_savings

    cands = [NS(signature="a", xla_ms=3.0, best_ms=1.0), NS(signature="b", xla_ms=1.0, best_ms=None)]
    groups = tuple(FusedGroup((n,), "matmul", {}, sig) for n, sig in enumerate("aabc"))
    assert alone_savings(NS(candidates=cands, plan=Plan("fp", groups))) == {"a": 4.0, "b": 0.0, "c": 0.0}


def test_the_composition_writes_each_programs_optimised_hlo(tmp_path) -> None:
    """`profile composition --hlo DIR`: each program's compiled module as `<name>.hlo.gz`, the folder made if missing."""
    import gzip

    import jax
    import jax.numpy as jnp

    from benchmarks.composition import write_hlo

    x = jnp.ones((8, 16), jnp.float32)
    write_hlo(str(tmp_path / "hlo"), {"jax_jit": jax.jit(lambda a: jnp.tanh(a) * 2), "plan": jax.jit(lambda a: a.sum(0))}, [x])
    texts = {p.name: gzip.open(p, "rt").read() for p in (tmp_path / "hlo").iterdir()}
    assert set(texts) == {"jax_jit.hlo.gz", "plan.hlo.gz"}
    assert "tanh" in texts["jax_jit.hlo.gz"] and "reduce" in texts["plan.hlo.gz"] and "tanh" not in texts["plan.hlo.gz"]


@pytest.mark.slow  # a benchmark's smoke run, not the quick subset's
def test_the_concat_sink_probe_checks_and_times_every_config(capsys) -> None:
    """`kernels concat-sink` at the CPU-sized GPT-2: one row per config, each checked against jax.jit."""
    from benchmarks import concat_sink_probe

    concat_sink_probe.main(["--small", "--repeats", "2"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| accumulate=")]
    assert len(rows) == len(concat_sink_probe.CONFIGS) and all("| ok (" in r for r in rows)


def test_the_workers_table_shows_a_worker_loop_and_its_trials_parts() -> None:
    """A worker's trial loop as the scaling table shows it: the sampler is what a trial's time is besides measuring
    and the claims, and the trial process's parts follow the measuring (`TrialResult.seconds`)."""
    from benchmarks.multi_gpu import loop_text

    parts = {"trials": 10.0, "measure": 6.0, "claim": 1.0, "pick": 0.5, "measure_build": 5.0, "measure_time": 0.5}
    assert loop_text(parts) == "measure 6.0, sampler 3.0, claims 1.0, pick 0.5 (measuring: build 5.0, time 0.5)"
    assert loop_text({"trials": 2.0, "measure": 1.0}) == "measure 1.0, sampler 1.0"  # a run from before the parts
    assert loop_text(None) == ""


def test_gemm_clocks_reads_the_sm_clock_of_a_window_from_nvidia_smis_samples() -> None:
    """The clock column of `kernels gemm-clocks`: nvidia-smi's CSV samples inside the window only, their median and the
    event reasons seen (a line nvidia-smi garbles is skipped, not an error)."""
    import datetime

    from benchmarks.gemm_clocks import clock_window

    def at(s: float) -> str:
        return datetime.datetime.fromtimestamp(1_800_000_000 + s).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    lines = [f"{at(0.0)}, 1980 MHz, 0x0000000000000000", f"{at(1.0)}, 1470 MHz, 0x0000000000000004",
             f"{at(1.1)}, 1440 MHz, 0x0000000000000004", "garbled", f"{at(1.2)}, 1500 MHz, 0x0000000000000004", f"{at(3.0)}, 1980 MHz, 0x0"]
    w = clock_window(lines, 1_800_000_000 + 0.5, 1_800_000_000 + 2.0)
    assert (w.samples, w.median_mhz, w.reasons) == (3, 1470, ("0x0000000000000004",))
    assert clock_window(lines, 1_800_000_010, 1_800_000_011).samples == 0


def test_gemm_clocks_pairs_each_mosaic_kernel_with_the_library_on_their_own_inputs() -> None:
    """`kernels gemm-clocks --pairs N`: every Mosaic GPU row that ran gets the ratio of its time over the library
    kernel's in N alternating pairs, each function called on its own input sets (cuDNN's are transposed), and the
    table shows it; the library's row and a failed row get none."""
    import jax
    import jax.numpy as jnp

    from benchmarks.gemm_clocks import _pair_cell, paired

    seen = []
    lib = jax.jit(lambda x: x * 2.0)
    slow = jax.jit(lambda x: jnp.sin(x) @ jnp.cos(x).T)

    def mosaic(x):
        seen.append(x.shape)
        return slow(x)
    lib_sets, sets = [(jnp.ones((8, 8)),)] * 3, [(jnp.ones((64, 64)),)] * 3
    rows = [({"kernel": "cudnn", "status": "ok", "workload": "w", "config": None}, lib, lib_sets),
            ({"kernel": "mosaic", "status": "ok", "workload": "w", "config": {}}, mosaic, sets),
            ({"kernel": "mosaic", "status": "wrong", "workload": "w", "config": {"x": 1}}, mosaic, sets)]
    paired(rows, "cudnn", 3)
    library, med, q1, q3, n = rows[1][0]["pair"]
    assert (library, n) == ("cudnn", 3) and q1 <= med <= q3 and med > 0
    assert set(seen) == {(64, 64)}  # the Mosaic GPU kernel only ever saw its own inputs
    assert "pair" not in rows[0][0] and "pair" not in rows[2][0] and _pair_cell(rows[2][0]) == ""
    assert _pair_cell(rows[1][0]).endswith("x cudnn, 3 pairs")


def test_attention_short_forms_name_their_backend_and_the_mosaic_gpu_flags() -> None:
    """`kernels attention-grad --configs`: Triton tiles, or a Mosaic GPU forward with its flags after the steps
    (o: the overlap, n: no schedule barrier, t: three compute warpgroups, p: persistent): every key of the lowering's
    config, so that a plan of it builds."""
    from autofuse.kernels.mosaic_gpu.attention import PARAMS
    from benchmarks.workloads import attention_config

    assert attention_config("128x64w8s3") == {"block_q": 128, "block_k": 64, "num_warps": 8, "num_stages": 3}
    base = {"backend": "mosaic_gpu", "block_q": 64, "block_kv": 128, "max_concurrent_steps": 2, "semantics": 0}
    assert attention_config("mgpu64x128s2") == {**base, "schedule_barrier": 1, "overlap": 0, "compute_wgs": 2, "persistent": 0}
    assert attention_config("mgpu64x128s2ont") == {**base, "schedule_barrier": 0, "overlap": 1, "compute_wgs": 3, "persistent": 0}
    assert attention_config("mgpu64x128s2onp") == {**base, "schedule_barrier": 0, "overlap": 1, "compute_wgs": 2, "persistent": 1}
    assert set(attention_config("mgpu64x128s2")) - {"backend"} == set(PARAMS)
    assert attention_config("mgpu64x128s12o")["max_concurrent_steps"] == 12


def test_attention_grad_pairs_time_each_pair_against_cudnn_in_alternation() -> None:
    """`kernels attention-grad --pairs N`: a pair's time over cuDNN's step in N alternating pairs (here two CPU programs,
    one doing twice the other's work), nothing without pairs or without a cuDNN step."""
    import jax
    import jax.numpy as jnp

    from benchmarks.attention_grad_bench import paired

    once = jax.jit(lambda x: jnp.tanh(x @ x))
    twice = jax.jit(lambda x: jnp.tanh(jnp.tanh(x @ x) @ x))
    sets = [[jnp.full((256, 256), 0.01 * (i + 1), jnp.float32)] for i in range(2)]
    cell = paired((once, sets), twice, sets, 3)
    ratio = float(cell.split("x cuDNN")[0])
    assert cell.endswith(")") and " in 3 alternating pairs (" in cell and ratio > 1.2
    assert paired((once, sets), twice, sets, 0) == "" and paired(None, twice, sets, 3) == ""


@pytest.mark.slow  # a benchmark's smoke run, not the quick subset's
def test_versus_serves_the_stored_plan_beside_both_jits_and_names_a_miss(tmp_path, capsys) -> None:
    """`deploy versus` at the CPU-sized GPT-2: the library-default forward, tuned into a store, through autofuse.jit
    with its plan, compared and timed against jax.jit of itself and of the cuDNN-asking forward (XLA's attention on a
    CPU, so the same numbers); a store without the plan is a one-line error, never jax.jit timed as a plan."""
    from benchmarks import versus
    from examples import gpt2

    db = str(tmp_path / "v.db")
    autofuse.tune(gpt2.forward_library, *gpt2.small_inputs(), trials=2, measure="model", quiet=True, store=db,
                  name="examples.gpt2:forward_library")
    args = ["--program", "examples.gpt2:forward_library", "--against", "examples.gpt2:forward_cudnn",
            "--inputs", "examples.gpt2:small_inputs", "--budget-s", "0.2"]
    versus.main(["--db", db, *args])
    out = capsys.readouterr().out
    assert "through autofuse.jit (plan: " in out
    rows = [line for line in out.splitlines() if line.startswith("| jax.jit `") or line.startswith("| autofuse.jit `")]
    assert len(rows) == 3
    cells = [[c.strip() for c in r.strip(" |").split("|")] for r in rows]
    assert all(float(c[4].split()[0]) < 1e-3 for c in cells)  # each output's error
    assert all(0 < float(c[5]) < 1 for c in cells)  # each program's peak device memory, GiB
    assert all(re.search(r"\| \d+\.\d\dx \(\d+\.\d\d\.\.\d+\.\d\d\) \|", r) for r in rows[:2])
    with pytest.raises(SystemExit, match="has no plan to serve here"):
        versus.main(["--db", str(tmp_path / "empty.db"), *args])
