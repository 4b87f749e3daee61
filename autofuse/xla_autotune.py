"""XLA's own autotuning, the same at tuning time and at deploy.

XLA autotunes every GEMM fusion (cuBLAS algorithms, its Triton GEMM tiles) at each compilation and does not
always pick the same kernels: on an H100 the same HLO compiled in two processes ran 7.05 ms and 7.95 ms. The
parts of a program a plan leaves to XLA, and the jax.jit baseline it was judged against, then drift between
the tuning job and the deployed process. `import autofuse` therefore points XLA's per-fusion autotune cache
(``--xla_gpu_per_fusion_autotune_cache_dir``) at one directory, where the trial processes of a tuning job
write what they chose and a deployed process reads it back, so that both compile the same kernels:
``$AUTOFUSE_XLA_AUTOTUNE_DIR``, else ``~/.cache/autofuse/xla-autotune/jaxlib-<version>`` (XLA leaves checking
that an entry was made by the same compiler to its user: a jaxlib upgrade starts a new directory). The plan store
carries the entries too: a tuning job that measured on a GPU copies the directory's files into it for its jaxlib and
GPU, and a deployed process that finds a plan there writes those missing from its own directory before compiling, so
shipping the plan database alone is enough (`read_entries`, `write_entries`). No flag is added where the user set their own,
where JAX's backends already started (XLA reads its flags once), or where the directory cannot be made. Imports
nothing from JAX.
"""
from __future__ import annotations

import importlib.metadata
import os

from .gpumem import backends_initialised

FLAG = "--xla_gpu_per_fusion_autotune_cache_dir"
ENV_DIR = "AUTOFUSE_XLA_AUTOTUNE_DIR"


def default_dir(environ: dict[str, str] | os._Environ = os.environ) -> str:
    """``$AUTOFUSE_XLA_AUTOTUNE_DIR`` as given, else one directory per jaxlib version under ``~/.cache/autofuse``."""
    if environ.get(ENV_DIR):
        return environ[ENV_DIR]
    return jaxlib_cache_dir("xla-autotune")


OFF = ("", "off", "none", "0")  # a cache directory's variable set to one of these: no cache


def chosen_dir(environ: dict[str, str] | os._Environ, var: str, default: str) -> str | None:
    """A cache's directory: ``$var`` as given (None where it says `OFF`), else `default`."""
    if var in environ:
        given = environ[var].strip()
        return None if given.lower() in OFF else given
    return default


def jaxlib_cache_dir(kind: str) -> str:
    """``~/.cache/autofuse/<kind>/jaxlib-<version>``: what this jaxlib's compiler made is kept apart from another's
    (an upgrade starts a new directory)."""
    try:
        version = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return os.path.join(os.path.expanduser("~"), ".cache", "autofuse", kind, f"jaxlib-{version}")


def trim_least_recent(files: list[str], max_bytes: int) -> None:
    """Delete the least recently used of `files` (the later of each one's access and modification time) until the rest
    hold at most `max_bytes`; a file another process deleted or is writing is skipped."""
    entries = []
    for path in files:
        try:
            st = os.stat(path)
        except OSError:
            continue
        entries.append((max(st.st_atime, st.st_mtime), st.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= max_bytes:
            return
        try:
            os.unlink(path)
            total -= size
        except OSError:
            pass


def configure(environ: dict[str, str] | os._Environ = os.environ) -> str | None:
    """Add the autotune cache flag to ``XLA_FLAGS`` where it still takes effect and the user set none; the
    directory XLA's autotuning results go to (the user's own where they set the flag), or None."""
    flags = environ.get("XLA_FLAGS", "")
    own = _own_flag(flags)
    if own is not None:
        return own or None
    if backends_initialised():
        return None
    path = default_dir(environ)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:  # a read-only home: XLA autotunes as it would without autofuse
        return None
    environ["XLA_FLAGS"] = f"{flags} {FLAG}={path}".strip()
    return path


DIR: str | None = None  # set by `import autofuse`


def trial_dir(environ: dict[str, str] | os._Environ = os.environ) -> str | None:
    """Where a tuning job's trial processes write XLA's autotune results: this process's directory (`DIR`), else
    the one `configure` gives a fresh process with this environment (the user's flag, else `default_dir`): a caller
    whose JAX had started before `import autofuse` has no directory itself, but its trial processes, which import
    autofuse before JAX starts, do."""
    if DIR is not None:
        return DIR
    own = _own_flag(environ.get("XLA_FLAGS", ""))
    return (own or None) if own is not None else default_dir(environ)


def _own_flag(flags: str) -> str | None:
    """The directory the user's ``XLA_FLAGS`` give XLA's autotune cache (the last such flag; "" if empty), or None."""
    own = [f.split("=", 1)[1] for f in flags.split() if f.startswith(FLAG + "=")]
    return own[-1] if own else None


# ----------------------------------------------------------------------- entries <-> files
# A tuning job copies the directory's entries into its plan store and a deploy writes them back (the store's side:
# `PlanStore.save_autotune` / `autotune_entries`), so that shipping the plan database alone is enough.

MAX_ENTRY_BYTES = 1 << 20  # one fusion's result is a few hundred bytes: anything far larger is not XLA's


def read_entries(path: str) -> dict[str, str]:
    """The entries of an autotune directory, file name (XLA's cache key) -> content: its top-level regular files
    (XLA writes each one whole, by renaming it from its ``tmp/`` subdirectory, which is skipped; so are hidden files,
    which include our own half-written ones). Files that vanish or are not text are skipped."""
    out: dict[str, str] = {}
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return out
    for name in names:
        full = os.path.join(path, name)
        if name.startswith(".") or not os.path.isfile(full) or os.path.getsize(full) > MAX_ENTRY_BYTES:
            continue
        try:
            with open(full, "rb") as f:
                out[name] = f.read().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
    return out


def write_entries(path: str, entries: dict[str, str]) -> list[str]:
    """Write the `entries` missing from the directory `path` (never overwriting a file there: the local one is what
    this machine's XLA chose); the names written. Each file appears whole (written aside, then linked into place),
    since a compile running meanwhile in another process would fail on a partial one. Raises OSError where the
    directory cannot be written."""
    written = []
    for name, content in entries.items():
        if os.path.basename(name) != name or name.startswith(".") or os.path.exists(os.path.join(path, name)):
            continue  # a name that is not one plain file name is not XLA's: never write outside the directory
        if _write_new(os.path.join(path, name), content.encode("utf-8")):
            written.append(name)
    return written


def _write_new(target: str, data: bytes) -> bool:
    """Put `data` at `target` atomically unless a file is there already; whether it was written."""
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".autofuse-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        try:
            os.link(tmp, target)  # fails where the file exists: never replaces one made meanwhile
        except FileExistsError:
            return False
        except OSError:  # a file system without hard links
            if os.path.exists(target):
                return False
            os.replace(tmp, target)
        return True
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
