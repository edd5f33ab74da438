"""
llmc/utils.py: the error every command-line tool reports in one line, writing files so that a
crash never leaves one that looks complete (llm.c's llmc/utils.h: fopenCheck and friends), the
two rules that keep a run to its own files in -o (a temporary is removed only when its name is
the run's and its writer is gone; one run at a time holds the directory's lock), and prefix,
the view of a buffer's first elements that every (B,T) of a preallocated buffer uses.
"""

import fcntl
import math
import os
import re
import socket
import urllib.parse


class InputError(Exception):
    """Bad user input or a bad file. The command line prints it as one `error:` line and exits 1."""


TMP_SUFFIX = ".tmp"                    # atomic_write writes `<path>.tmp<pid>`, then renames

# The pip package that provides each third-party module a tool may need (where the names differ,
# the pip name is the one to install).
PIP_PACKAGES = {"numpy": "numpy", "matplotlib": "matplotlib", "tiktoken": "tiktoken", "torch": "torch", "transformers": "transformers",
                "safetensors": "safetensors", "mpi4py": "mpi4py", "tqdm": "tqdm"}
# The one command that installs each (dev/setup_env.py's targets): `make train` the small ones the
# README's commands use, `make twin` torch (about 2 GB), dev/setup_env.py's test target the rest
INSTALLED_BY = {"numpy": "make train", "tiktoken": "make train", "matplotlib": "make train", "safetensors": "make train",
                "tqdm": "make train", "torch": "make twin", "transformers": "python3 dev/setup_env.py test",
                "mpi4py": "python3 dev/setup_env.py test"}
PROJECT_VENV = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv")


def missing_package_line(tool, module, python, in_virtual_env, project_venv_exists):
    """The one `error:` line for a tool whose third-party `module` is missing from `python` (the
    interpreter's path): the pip package and the one command that installs it. Outside any virtual
    environment while the project's .venv exists (made by `make`), the advice is first to activate
    it; inside one (the project's or another), the command installs into that one."""
    package = PIP_PACKAGES.get(module, module)
    install = INSTALLED_BY.get(module, f"pip install {package}")
    line = f"error: {tool} needs the pip package {package}, which this Python ({python}) does not have: "
    if in_virtual_env:
        return line + f"`{install}` installs it into this environment"
    if project_venv_exists:
        return line + (f"activate the project's environment first (source .venv/bin/activate); if it lacks "
                       f"{package} too, `{install}` installs it there")
    return line + f"`{install}` installs it into the project's environment .venv (then: source .venv/bin/activate)"


def require(tool, *modules):
    """Import the third-party `modules` a command-line tool needs before it does anything; for the
    first one that is missing, print one `error:` line naming its pip package and the command that
    installs it (missing_package_line), and exit 1. Returns nothing; the tool then imports the
    modules as usual."""
    import importlib
    import sys
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            if (e.name or module).split(".")[0] != module.split(".")[0]:
                raise                                          # the package is there but broken: its own error
            in_virtual_env = sys.prefix != sys.base_prefix or bool(os.environ.get("VIRTUAL_ENV"))
            print(missing_package_line(tool, module, sys.executable, in_virtual_env, os.path.isdir(PROJECT_VENV)),
                  file=sys.stderr)
            sys.exit(1)


def physical_memory_bytes():
    """This machine's RAM in bytes (int), from sysconf (Linux and macOS)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def atomic_write(path, write_fn):
    """Write a file through `write_fn(f)` to the temporary name `<path>.tmp<pid>`, fsync, then
    rename it into place, so a crash mid-write never leaves a file that looks complete. The
    temporary file is removed on any error."""
    tmp = f"{path}{TMP_SUFFIX}{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write_fn(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def process_alive(pid):
    """Whether a process with this pid runs on this machine (signal 0 probes without sending)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:            # alive, another user's
        return True
    return True


def stale_temporaries(directory, own_names):
    """The temporary files `<name>.tmp<pid>` in `directory` that atomic_write left when a run was
    killed mid-write: only those whose <name> matches the regex `own_names` (the names the caller
    writes, so a user's `notes.tmp2024` is never one) and whose writer, process <pid>, is gone
    (a live run's temporary is still being written)."""
    pattern = re.compile(f"({own_names}){re.escape(TMP_SUFFIX)}(\\d+)$")
    stale = []
    for name in sorted(os.listdir(directory)):
        match = pattern.fullmatch(name)
        if match and os.path.isfile(os.path.join(directory, name)):
            pid = int(match.group(match.lastindex))
            if pid != os.getpid() and not process_alive(pid):
                stale.append(os.path.join(directory, name))
    return stale


LOCK_NAME = ".llmc.lock"               # the run lock file in -o (lock_directory)
_held_locks = {}                       # directory (real path) -> (its open lock file, its directory fd or None)


def check_input_file(path, what):
    """Raise InputError unless `path` is a regular file a program can read: "<path>: no such <what>"
    when nothing is there, "<path>: <what> is not a regular file" for a FIFO, a device or a
    directory, which every reader refuses before it opens them: a FIFO would wait forever for a
    writer, a device would read forever."""
    if not os.path.lexists(path):
        raise InputError(f"{path}: no such {what}")
    if not os.path.isfile(path):
        kind = "a directory" if os.path.isdir(path) else "a FIFO, a device or a socket"
        raise InputError(f"{path}: not a regular file ({kind}), so not a {what}: pass the file itself")


def check_regular_file(path, what):
    """Raise InputError if `path` exists but is not a regular file (a FIFO, a device, a
    directory): opening a FIFO waits forever for a writer or a reader, and a device reads forever."""
    if os.path.lexists(path) and not os.path.isfile(path):
        raise InputError(f"{path}: {what} is not a regular file (a FIFO, a device or a directory): remove it, "
                         f"or use another directory")


def lock_directory(directory):
    """Take `directory`'s run lock, held until this process exits, in two ways, because a user may
    delete the lock file while the run lives (a new file then locks freely) but cannot delete the
    directory without its files: an exclusive flock on the directory itself, and an exclusive fcntl
    (POSIX record) lock on directory/LOCK_NAME, which holds the owner's pid for the message and is
    what a network file system without flock on directories (NFS) still has. The kernel releases
    both when the process dies, even by kill -9, so a lock is never stale. Taking it again in the
    same process is a no-op. Returns the open lock file. Raises InputError naming the pid (when
    the lock file still holds it) when another process holds either."""
    key = os.path.realpath(directory)
    if key in _held_locks:
        return _held_locks[key][0]
    lock_path = os.path.join(directory, LOCK_NAME)
    check_regular_file(lock_path, "the run lock")
    directory_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(directory_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:                              # another run holds the directory
        os.close(directory_fd)
        raise InputError(another_run(directory, lock_path)) from None
    except OSError:                                      # no flock on this file system's directories
        os.close(directory_fd)
        directory_fd = None
    try:
        f = open(lock_path, "a+")
    except OSError as e:                                 # a read-only -o, permissions
        if directory_fd is not None:
            os.close(directory_fd)
        raise InputError(f"-o {directory}: cannot write there ({e.strerror or e}): a training run writes its "
                         f"lock, checkpoints and main.log in -o") from None
    try:
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        if directory_fd is not None:
            os.close(directory_fd)
        raise InputError(another_run(directory, lock_path)) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    _held_locks[key] = (f, directory_fd)
    return f


def another_run(directory, lock_path):
    """The line for a directory whose lock another process holds, with its pid where the lock
    file still holds one (the user may have deleted the file: the directory's own lock remains)."""
    try:
        with open(lock_path) as f:
            owner = f.read().strip()
    except OSError:
        owner = ""
    who = f"another run (pid {owner})" if owner.isdigit() else "another run"
    return f"-o {directory}: {who} is using this directory: wait for it to end, or use another -o"


def release_directory_locks():
    """Release every lock lock_directory took in this process (the end of a command: the
    command line's run_main calls it, so a process that runs several commands, as the tests
    do, holds none between them)."""
    while _held_locks:
        f, directory_fd = _held_locks.popitem()[1]
        f.close()
        if directory_fd is not None:
            os.close(directory_fd)


def prefix(buf, shape):
    """View of the first prod(shape) elements of a contiguous buffer, reshaped (no copy)."""
    return buf.reshape(-1)[:math.prod(shape)].reshape(shape)


REACH_TIMEOUT_S = 10                   # a dead network fails in seconds, not after the hub's retries


def check_reachable(url, offline_hint, timeout_s=REACH_TIMEOUT_S):
    """Raise InputError (one line, ending with offline_hint) unless a TCP connection to url's host
    opens within timeout_s: offline, the Hugging Face hub's client would retry for ~20 s and log
    every retry (dev/data's downloads, dev/eval's imports)."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as e:
        raise InputError(f"cannot reach {parts.hostname} ({e}): offline? {offline_hint}")
