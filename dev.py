#!/usr/bin/env python3
"""Run django-fairqueue's development tasks from a fresh clone. Standard library only.

    python3 dev.py test [PYTEST ARGS]   run the test suite
    python3 dev.py demo [ARGS]          run the example project's demo
    python3 dev.py tox [TOX ARGS]       run tox (Python x Django matrix, lint, migrations, docs)
    python3 dev.py manage ARGS          example_project/manage.py ARGS

The first run creates .venv with the interpreter running this script and installs the project
with its ``dev`` extra (about a minute); later runs reinstall only when pyproject.toml changed.
No database setup is needed: without DATABASE_URL an embedded PostgreSQL is started in
.fairqueue/ and left running (``.venv/bin/python -m django_fairqueue.devdb stop`` stops it).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / "bin"
PYTHON = BIN / "python"
STAMP = VENV / ".fairqueue-installed"
#: Bump to force a reinstall everywhere when the install command itself changes.
INSTALL_RECIPE = "1: uv pip install -e .[dev]"
#: Interpreters the tox environments ask for.
TOX_PYTHONS = ("3.11", "3.12", "3.13")


def say(message: str) -> None:
    print(f"dev.py: {message}", file=sys.stderr, flush=True)


def run(*command: str | Path) -> bool:
    return subprocess.run([str(part) for part in command], check=False).returncode == 0


def ensure_venv() -> None:
    if PYTHON.exists() and subprocess.run([PYTHON, "-c", ""], check=False).returncode == 0:
        return
    if VENV.exists():
        say(f"{VENV.name} is broken (its Python is gone?): recreating it")
        shutil.rmtree(VENV)
    version = ".".join(map(str, sys.version_info[:3]))
    say(f"creating .venv with Python {version} ({sys.executable})")
    if not run(sys.executable, "-m", "venv", VENV):
        sys.exit("dev.py: could not create .venv (on Debian/Ubuntu: apt-get install python3-venv)")


def wanted_stamp() -> str:
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes())
    digest.update(INSTALL_RECIPE.encode())
    return digest.hexdigest()


def pip_install(*requirements: str) -> None:
    """Install into .venv with uv (fast), falling back to pip if uv is unavailable or fails."""
    uv = BIN / "uv"
    if not uv.exists():
        run(PYTHON, "-m", "pip", "install", "--quiet", "uv")
    if uv.exists() and run(uv, "pip", "install", "--quiet", "--python", PYTHON, *requirements):
        return
    say("uv failed; falling back to pip")
    if not run(PYTHON, "-m", "pip", "install", "--quiet", *requirements):
        sys.exit("dev.py: installing dependencies failed")


def ensure_installed() -> None:
    ensure_venv()
    stamp = wanted_stamp()
    if STAMP.exists() and STAMP.read_text().strip() == stamp:
        return
    first = not STAMP.exists()
    say(
        "installing dependencies (first run ~1 min)"
        if first
        else "pyproject.toml changed: reinstalling"
    )
    pip_install("-e", ".[dev]")
    STAMP.write_text(stamp + "\n")


def tox_python_dir() -> Path:
    """A directory of ``python3.X`` links for tox to find, where PATH has no working one.

    tox-uv asks uv for ``python3.12``; uv only searches PATH, where pyenv's shims exist for every
    installed version but fail for those not selected. Link pyenv's real interpreters instead.
    """
    # Not inside .venv: Python reads ../pyvenv.cfg next to its executable and would believe it
    # is that venv's interpreter.
    links = ROOT / ".tox" / "pythons"
    shutil.rmtree(links, ignore_errors=True)
    links.mkdir(parents=True)
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    for minor in TOX_PYTHONS:
        name = f"python{minor}"
        found = shutil.which(name)
        if found and subprocess.run([found, "-c", ""], capture_output=True).returncode == 0:
            continue
        candidates = sorted(
            pyenv_root.glob(f"versions/{minor}.*/bin/{name}"),
            key=lambda path: tuple(int(p) for p in path.parts[-3].split(".") if p.isdigit()),
        )
        if candidates:
            (links / name).symlink_to(candidates[-1])
    return links


def command_tox(args: list[str]) -> None:
    ensure_installed()
    if not (BIN / "tox").exists() or not run(PYTHON, "-c", "import tox_uv"):
        say("installing tox and tox-uv")
        pip_install("tox>=4.20", "tox-uv>=1.11")
    env = dict(os.environ)
    env["PATH"] = f"{tox_python_dir()}{os.pathsep}{env.get('PATH', '')}"
    # A missing interpreter must be reported, not fetched from the network behind our back.
    env.setdefault("UV_PYTHON_DOWNLOADS", "never")
    exec_(BIN / "tox", *args, env=env)


def exec_(*command: str | Path, env: dict[str, str] | None = None) -> None:
    """Replace this process, so signals and the exit code are the command's own."""
    argv = [str(part) for part in command]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env if env is not None else os.environ)


def main(argv: list[str]) -> None:
    os.chdir(ROOT)  # the embedded PostgreSQL lives in ./.fairqueue; keep one per checkout
    if not argv or argv[0] in {"-h", "--help", "help"}:
        print(__doc__)
        sys.exit(0 if argv else 2)
    command, args = argv[0], argv[1:]
    if command == "test":
        ensure_installed()
        exec_(PYTHON, "-m", "pytest", *args)
    elif command == "demo":
        ensure_installed()
        exec_(PYTHON, "example_project/manage.py", "fairdemo", *args)
    elif command == "manage":
        ensure_installed()
        exec_(PYTHON, "example_project/manage.py", *args)
    elif command == "tox":
        command_tox(args)
    else:
        sys.exit(f"dev.py: unknown command {command!r}; see python3 dev.py --help")


if __name__ == "__main__":
    main(sys.argv[1:])
