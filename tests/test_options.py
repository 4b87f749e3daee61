"""Issue 34, item 6: one options object for a job. `tune` checks its arguments once into a `Job` and hands that same
object to whichever driver runs it; its old keywords still work, folded into `JobOptions`; arguments reach a child
process through one codec."""
from __future__ import annotations

import dataclasses
import inspect
import json

import jax
import jax.numpy as jnp
import pytest

import autofuse
from autofuse.codec import EncodeError, decode_call, encode, encode_call
from autofuse.tuning import local, workers
from autofuse.tuning.options import JobOptions
from benchmarks.workloads import rms_norm

X = jax.ShapeDtypeStruct((8, 16), jnp.float32)


@pytest.fixture
def drivers(monkeypatch) -> dict[str, tuple]:
    """Both drivers replaced by recorders of what they receive."""
    got: dict[str, tuple] = {}
    monkeypatch.setattr(local, "tune_here", lambda fn, args, kwargs, job: got.setdefault("local", (fn, args, kwargs, job)))
    monkeypatch.setattr(workers, "tune_with_workers",
                        lambda fn, args, kwargs, job, *, workers: got.setdefault("workers", (fn, args, kwargs, job, workers)))
    return got


def test_local_and_worker_drivers_receive_the_same_job(drivers, tmp_path) -> None:
    url = f"sqlite:///{tmp_path}/o.db"
    common = dict(trials=5, store=url, seed=3, quiet=True, isolate=False, trial_timeout_s=7, name="n", static_argnums=1, max_memory="1GiB")
    autofuse.tune(rms_norm, X, 2, **common)
    autofuse.tune(rms_norm, X, 2, workers=2, **common)
    (_, args, kwargs, job), (_, wargs, wkwargs, wjob, n) = drivers["local"], drivers["workers"]
    assert job == wjob and (args, kwargs) == (wargs, wkwargs) == ((X, 2), {}) and n == 2
    assert job.options == JobOptions(name="n", isolate=False, trial_timeout_s=7, static_argnums=(1,))
    assert (job.trials, job.seed, job.store, job.quiet, job.max_memory_bytes) == (5, 3, url, True, 2**30)


def test_old_keywords_and_an_options_object_fold_together(drivers) -> None:
    """A keyword given beside `options` wins over the object's value; `effort` names the trial budget."""
    autofuse.tune(rms_norm, X, store=False, effort="quick", options=JobOptions(name="a", heartbeat_s=3), name="b")
    job = drivers["local"][3]
    assert job.options == JobOptions(name="b", heartbeat_s=3) and job.trials == 16 and job.store is None


def test_an_unknown_keyword_is_a_one_line_type_error(drivers) -> None:
    with pytest.raises(TypeError) as e:
        autofuse.tune(rms_norm, X, trial_timeout=5)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("tune() got an unexpected keyword argument 'trial_timeout'")
    assert "trial_timeout_s" in msg and "kwargs=" in msg and not drivers


def test_options_are_checked_where_they_are_made() -> None:
    with pytest.raises(ValueError, match="trial_timeout_s must be a positive"):
        JobOptions(trial_timeout_s=0)
    with pytest.raises(ValueError, match="heartbeat interval"):
        JobOptions(heartbeat_s=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        JobOptions().isolate = False  # type: ignore[misc]
    assert JobOptions(static_argnames="k").static_argnames == ("k",)


def test_tune_keeps_a_short_signature() -> None:
    params = inspect.signature(autofuse.tune).parameters
    assert len(params) <= 20 and "trial_timeout_s" not in params and "options" in params


def test_a_worker_reads_back_the_options_its_launcher_wrote() -> None:
    """The run's job row carries the plain options (never the hooks) as JSON."""
    o = JobOptions(name="n", model="h100", isolate=False, trial_timeout_s=9.5, heartbeat_s=4, compile_workers=2, static_argnums=(1,),
                   static_argnames=("k",), progress=print)
    back = JobOptions.from_wire(json.loads(json.dumps(o.to_wire())))
    assert back == dataclasses.replace(o, name=None, progress=None)


def test_one_codec_for_workers_and_background_jobs() -> None:
    """A static tuple comes back a tuple (hashable, as jax.jit needs a static argument), arrays as shape structs."""
    args, kwargs = decode_call(*json.loads(json.dumps(encode_call((jnp.zeros((2, 3), jnp.bfloat16), (1, 2)), {"k": "s"}))))
    assert args == (jax.ShapeDtypeStruct((2, 3), jnp.bfloat16), (1, 2)) and kwargs == {"k": "s"}
    with pytest.raises(EncodeError, match="cannot describe a dict with keys other than strings"):
        encode({1: X})
