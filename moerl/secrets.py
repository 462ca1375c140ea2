"""Reading a credential: from a file named by `$<NAME>_FILE`, else from `$<NAME>`.

Design, details and limitations: docs/eks.md#moerlsecretspy.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from moerl.errors import MoerlError

# Where a pod's Secret volumes are mounted, one directory per Secret (pipelines/eks.py `place`,
# moerl.launch.objects): `<SECRETS_ROOT>/<secret>/<key>`. Hidden from sandboxed children.
SECRETS_ROOT = "/var/run/secrets/moerl"
FILE_SUFFIX = "_FILE"


class SecretFileError(MoerlError):
    """A credential file that cannot be used: missing, unreadable, or open to others."""


def file_var(name: str) -> str:
    """The variable that names `name`'s file: VALKEY_PASSWORD -> VALKEY_PASSWORD_FILE."""
    return name + FILE_SUFFIX


def check_secret_file(path: str | Path, var: str = "the file") -> Path:
    """`path` if a credential may be read from it (see the module docstring), else raise
    `SecretFileError` naming `var` and the file. Symlinks are followed (a Secret volume's files
    are links into its `..data` directory): the mode that counts is the target's."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError as err:
        raise SecretFileError(
            f"${var}={path}: cannot read the credential file ({err.strerror}); mount the Secret "
            f"there or unset {var}"
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise SecretFileError(
            f"${var}={path}: not a regular file; point {var} at the Secret's key file"
        )
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid == os.geteuid() and mode & 0o077:
        raise SecretFileError(
            f"${var}={path}: mode {stat.filemode(st.st_mode)} lets other users read or write a "
            f"credential this user owns; chmod 400 {path}"
        )
    if st.st_uid != os.geteuid() and mode & 0o022:
        raise SecretFileError(
            f"${var}={path}: mode {stat.filemode(st.st_mode)} lets users other than its owner "
            f"(uid {st.st_uid}) change the credential; mount it read-only (a Secret volume)"
        )
    return path


def read_secret(name: str, environ: dict[str, str] | os._Environ | None = None) -> str | None:
    """The credential `name`: the content of the file `$<name>_FILE` (checked by
    `check_secret_file`; one trailing newline dropped, as `kubectl create secret --from-file`
    keeps an editor's), else `$<name>`, else None. An empty value, or a file that does not exist
    (an optional Secret's empty volume), is None."""
    environ = os.environ if environ is None else environ
    var = file_var(name)
    if path := environ.get(var):
        if not os.path.lexists(path):
            # an optional Secret (or key) the cluster does not hold: Kubernetes mounts its volume
            # empty, as it leaves out an optional secretKeyRef variable. A required one stops the
            # pod before it starts, so a missing file here means "not given"
            return None
        value = check_secret_file(path, var).read_text()
        value = value[:-1] if value.endswith("\n") else value
        return value or None
    return environ.get(name) or None


# Variables whose file is a credential (by the name it stands for): what `secret_dirs` hides
_CREDENTIAL_WORDS = ("PASSWORD", "USERNAME", "ACCESS_KEY", "SECRET", "TOKEN")


def secret_dirs(environ: dict[str, str] | os._Environ | None = None) -> list[str]:
    """The directories of this process's credential files, which a sandboxed child must not
    see (moerl.tasks.isolation mounts an empty tmpfs over each): `SECRETS_ROOT` (a pod's Secret
    volumes) and the directory of every `<credential>_FILE` this process holds (the
    cluster-shaped test's sandbox, a local run's own files)."""
    environ = os.environ if environ is None else environ
    dirs = {SECRETS_ROOT}
    for var, path in environ.items():
        name = var.removesuffix(FILE_SUFFIX)
        if var.endswith(FILE_SUFFIX) and path and any(w in name for w in _CREDENTIAL_WORDS):
            parent = os.path.dirname(os.path.realpath(path))
            if parent not in ("", "/"):
                dirs.add(parent)
    return sorted(dirs)


def write_secret_file(path: Path, value: str) -> Path:
    """Write `value` to `path` created 0400 (never readable by others, even for an instant),
    its directory 0700: how the cluster-shaped test's sandbox gives a task its pod's files."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "w") as f:
        f.write(value)
    return path
