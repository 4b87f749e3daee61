"""`python -m benchmarks profile group`: one candidate of an example model's program timed against XLA under chosen
configs, on the CPU in interpret mode (small inputs): the candidates listed once each, a grid of configs each
checked and timed beside XLA's row, and a signature no candidate has refused in one line."""
from __future__ import annotations

import re

import pytest

from benchmarks import group_probe


def _listed(capsys) -> list[list[str]]:
    group_probe.main(["--model", "gpt2", "--step", "grad_step_cudnn", "--small", "--list"])
    return [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()]


def test_the_list_names_each_candidate_once_with_its_template_and_instances(capsys) -> None:
    rows = _listed(capsys)
    assert len({r[0] for r in rows}) == len(rows) > 10
    assert {r[1] for r in rows} >= {"matmul", "row_reduce"}
    assert all(re.fullmatch(r"[0-9a-f]{12}", r[0]) and re.fullmatch(r"x\d+", r[2]) for r in rows)


def test_a_grid_of_configs_is_checked_and_timed_beside_xla(capsys, tmp_path) -> None:
    norm_grad = next(r[0] for r in _listed(capsys) if r[1] == "row_reduce" and int(r[3]) > 25)  # a norm's backward (dx)
    out = tmp_path / "probe.md"
    group_probe.main(["--small", "--group", norm_grad, "--grid", "block_rows=1,2", "--config", '{"num_warps": 4}',
                      "--config", '{"row_steps": 2}', "--out", str(out), "--commit", "test"])
    rows = [line for line in out.read_text().splitlines() if line.startswith(f"| {norm_grad}")]
    cells = [[c.strip() for c in r.split("|")[2:6]] for r in rows]
    assert [c[:2] for c in cells] == [["XLA", ""], ["row_reduce", "default"]] + [
        ["row_reduce", f'{{"block_rows": {bm}, "num_warps": 4}}'] for bm in (1, 2)] + [
        ["row_reduce", f'{{"block_rows": {bm}, "row_steps": 2}}'] for bm in (1, 2)]
    assert all(c[2] == "ok" and float(c[3]) > 0 for c in cells[:4])  # checked against XLA, then timed
    # walking row blocks without column sums to save: refused before it compiles, a row of the table each
    assert all(c[2] == "compile_error" and "row_steps > 1 needs column sums" in r for c, r in zip(cells[4:], rows[4:]))
    assert "commit test" in out.read_text().splitlines()[0]


def test_prices_without_a_gpu_trace_say_so(capsys) -> None:
    group = next(r[0] for r in _listed(capsys) if r[1] == "matmul")
    group_probe.main(["--small", "--group", group, "--prices", "--commit", "test"])
    assert capsys.readouterr().out.rstrip().endswith("jax.jit's program gave no profile here (no GPU trace): no prices")


def test_an_unknown_group_is_one_line() -> None:
    with pytest.raises(SystemExit, match="no candidate's signature starts with 'ffffffffffff'"):
        group_probe.main(["--small", "--group", "ffffffffffff"])


@pytest.mark.parametrize("bad, said", [("{block_rows: 1}", "not JSON"), ("[1, 2]", "not a JSON object")])
def test_a_config_that_is_not_a_json_object_is_one_line(bad: str, said: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        group_probe.main(["--small", "--group", "ffffffffffff", "--config", bad])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and said in err[-1] and "Traceback" not in "\n".join(err)
