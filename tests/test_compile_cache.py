"""One persistent JAX compilation cache for a tuning job's processes and deploys (`autofuse.compile_cache`): a program
one process compiled is loaded, not compiled, by the next; the user's own cache and `off` are honoured. Real
subprocesses, since JAX reads its cache settings once per process."""
from __future__ import annotations

import os
import subprocess
import sys

from autofuse import compile_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAM = """
import autofuse, jax, jax.numpy as jnp
from jax import monitoring
hits = []
monitoring.register_event_listener(lambda name, **kw: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else None)
jax.jit(lambda x: jnp.tanh(x) @ x.T).lower(jnp.ones((256, 256))).compile()
print(jax.config.jax_compilation_cache_dir, len(hits), jax.config.jax_compilation_cache_max_size)
"""


def _run(env: dict[str, str]) -> list[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", compile_cache.ENV_DIR))}
    out = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, env={**base, "PYTHONPATH": ROOT,
                         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", **env}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


def test_a_program_compiled_in_one_process_is_loaded_by_the_next(tmp_path):
    cache = str(tmp_path / "cache")
    first = _run({compile_cache.ENV_DIR: cache})
    assert first == [cache, "0", "-1"] and os.listdir(cache)  # compiled and written
    again = _run({compile_cache.ENV_DIR: cache})
    assert again[0] == cache and int(again[1]) >= 1  # loaded, not compiled (the program and the small ones making its input)
    # JAX's own eviction stays off: it would take one lock file for every read and write of the cache
    assert ".lockfile" not in os.listdir(cache) and compile_cache.TRIMMED in os.listdir(cache)


def test_the_users_own_cache_and_off_are_honoured(tmp_path):
    own = str(tmp_path / "own")
    assert _run({"JAX_COMPILATION_CACHE_DIR": own, compile_cache.ENV_DIR: str(tmp_path / "ours")})[0] == own
    assert not (tmp_path / "ours").exists()
    assert _run({compile_cache.ENV_DIR: "off"})[0] == "None"


def test_configured_through_jax_config_where_jax_was_imported_first(tmp_path):
    import jax

    before = jax.config.jax_compilation_cache_dir, jax.config.jax_compilation_cache_max_size
    environ = {compile_cache.ENV_DIR: str(tmp_path / "c")}
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        assert compile_cache.configure(environ) == str(tmp_path / "c")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "c") and "JAX_COMPILATION_CACHE_DIR" not in environ
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_compilation_cache_max_size", before[1])


def test_short_compiles_are_kept_only_in_the_cache_autofuse_chose(tmp_path, monkeypatch):
    """On a GPU a kernel compiles in 0.2-1.2 s, under JAX's one-second threshold: `keep_short_compiles` lowers it
    where autofuse chose the cache, and leaves the user's cache and the user's threshold alone."""
    import jax

    before = jax.config.jax_persistent_cache_min_compile_time_secs
    ours = {compile_cache.ENV_DIR: str(tmp_path / "c")}
    try:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        monkeypatch.setattr(compile_cache, "DIR", str(tmp_path / "own"))  # the user's JAX_COMPILATION_CACHE_DIR
        assert not compile_cache.keep_short_compiles(ours)
        monkeypatch.setattr(compile_cache, "DIR", str(tmp_path / "c"))
        assert not compile_cache.keep_short_compiles({**ours, compile_cache.JAX_MIN: "2"})  # the user's threshold
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0
        assert compile_cache.keep_short_compiles(ours)
        assert jax.config.jax_persistent_cache_min_compile_time_secs == compile_cache.MIN_COMPILE_S
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def _entry(path, name: str, size: int, used: float) -> str:
    f = path / name
    f.write_bytes(b"x" * size)
    os.utime(f, (used, used))
    return name


def test_trim_deletes_the_least_recently_used_entries_and_their_atime_files(tmp_path):
    """`trim` keeps the most recently used `<key>-cache` entries that fit, deletes the `<key>-atime` files JAX's own
    eviction left beside the entries it deleted, and leaves other files alone."""
    old = _entry(tmp_path, "a-cache", 400, 1_000)
    _entry(tmp_path, "a-atime", 8, 5_000)  # an atime file is no entry: its own time does not count
    mid = _entry(tmp_path, "b-cache", 400, 2_000)
    new = _entry(tmp_path, "c-cache", 400, 3_000)
    _entry(tmp_path, compile_cache.TRIMMED, 0, 10)
    compile_cache.trim(str(tmp_path), max_bytes=900)
    assert sorted(os.listdir(tmp_path)) == sorted([mid, new, compile_cache.TRIMMED])
    assert old not in os.listdir(tmp_path)
    compile_cache.trim(str(tmp_path), max_bytes=0)
    assert os.listdir(tmp_path) == [compile_cache.TRIMMED]


def test_the_cache_is_trimmed_at_most_once_in_a_while(tmp_path):
    """Importing autofuse trims its cache (`trim_now_and_then`), but a directory trimmed less than `every_s` ago is not
    scanned again: every process of a job imports autofuse."""
    _entry(tmp_path, "a-cache", 100, 1_000)
    assert compile_cache.trim_now_and_then(str(tmp_path), every_s=3600, max_bytes=50)
    assert os.listdir(tmp_path) == [compile_cache.TRIMMED]
    _entry(tmp_path, "b-cache", 100, 2_000)
    assert not compile_cache.trim_now_and_then(str(tmp_path), every_s=3600, max_bytes=50)
    assert "b-cache" in os.listdir(tmp_path)
    assert compile_cache.trim_now_and_then(str(tmp_path), every_s=0, max_bytes=50)
    assert os.listdir(tmp_path) == [compile_cache.TRIMMED]
