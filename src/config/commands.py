"""Commands the project prints for users to paste: every argument quoted for the shell and, where it is a Hydra
override, for Hydra's override grammar, so that a path with spaces, quotes, `;`, `$()`, `=`, `,` or non-ASCII
letters reads back as itself and runs nothing. They run from the folder they were printed in, the repository's
or a user's own."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: train.py and the src package
_PLAIN = re.compile(r"[A-Za-z0-9_./:+-]+")  # read by Hydra as an unquoted string as it is
_SPECIAL = re.compile(r"(\\*)('|\$\{|$)")


def hydra_value(value) -> str:
    """`value` as one Hydra override value that Hydra (and OmegaConf's interpolation) reads back unchanged."""
    text = str(value)
    if _PLAIN.fullmatch(text):
        return text
    # quoted, Hydra reads a backslash as itself except before a quote or `${` (which it then escapes: `\${` is a
    # literal `${`, not an interpolation) and in a run of them that ends there or at the closing quote (halved)
    escaped = _SPECIAL.sub(lambda m: m[1] * 2 + ("\\" + m[2] if m[2] else ""), text)
    return f"'{escaped}'"


def override(key: str, value) -> str:
    """`key=value` as one shell word."""
    return shlex.quote(f"{key}={hydra_value(value)}")


def train_command(*overrides: tuple[str, object]) -> str:
    """`python train.py key=value ...`, paste-safe; from another folder, train.py by its path."""
    script = "train.py" if _in_root() else shlex.quote(str(ROOT / "train.py"))
    return " ".join(["python", script, *(override(k, v) for k, v in overrides)])


def module_command(module: str, *args) -> str:
    """`python -m <module> args...`, each argument one shell word. From another folder, `python -m src...` would
    not find this package (or find a `src` of that folder's): the command runs in a subshell that moves to the
    repository, the user's shell staying where it is, with each Path argument made absolute."""
    here = _in_root()
    words = [shlex.quote(str(a) if here or not isinstance(a, Path) else os.path.abspath(a)) for a in args]
    command = " ".join(["python", "-m", module, *words])
    return command if here else f"(cd {shlex.quote(str(ROOT))} && {command})"


def _in_root() -> bool:
    try:
        return Path.cwd().resolve() == ROOT
    except OSError:  # this process's folder was removed
        return False
