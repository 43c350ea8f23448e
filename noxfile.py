"""Developer and CI sessions: ``nox`` runs lint, typecheck and tests; ``nox -s NAME`` the rest."""

from __future__ import annotations

from pathlib import Path

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
# A missing python3.11 must fail the run, not skip every session and report success.
nox.options.error_on_missing_interpreters = True

PYTHON = "3.11"
# Pinned here, never in the package: on these machines torch 2.13.0 is a CPU build on local
# disk, while an unpinned torch pulls a multi-GB CUDA build.
TORCH = "torch==2.13.0"
VLLM = "vllm==0.33.0"
# Our copy of ../shared/vllm-cpu/requirements-nodeps.txt: the part of vLLM's dependencies its
# scheduler side needs, installed with --no-deps (see that folder's README).
VLLM_REQUIREMENTS = Path(__file__).parent / "ci" / "vllm-requirements-nodeps.txt"
PYTEST = ("pytest", "-p", "no:cacheprovider")


def install(session: nox.Session, extras: str = "test") -> None:
    """Install the CPU torch first, then the package in editable mode with *extras*."""
    session.install(TORCH)
    session.install("-e", f".[{extras}]")


def install_vllm(session: nox.Session) -> None:
    """Install vLLM 0.33.0's scheduler side on the CPU torch, without its CUDA dependencies."""
    session.install("--no-deps", "-r", str(VLLM_REQUIREMENTS))
    session.install("--no-deps", VLLM)
    session.env["HF_HUB_OFFLINE"] = "1"


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """Ruff lint and format check."""
    session.install("ruff==0.17.6")  # pinned: a new ruff may format differently
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """Mypy, strict, on the package."""
    install(session, "test,dev")
    session.run("mypy", "src/kvtier_async")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The test suite without vLLM or a GPU; no test collected (exit 5) is a failure."""
    install(session)
    session.run(*PYTEST, "-m", "not vllm and not gpu", *session.posargs)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """All benchmarks (``nox -s bench -- --json`` for JSON lines), with vLLM as a reference."""
    install(session)
    install_vllm(session)
    session.run("kvtier", "bench", *session.posargs)


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The demo."""
    install(session)
    session.run("kvtier", "demo", *session.posargs)


@nox.session(python=PYTHON)
def vllm(session: nox.Session) -> None:
    """The vLLM integration tests, against vLLM 0.33.0 installed on the CPU torch."""
    install(session)
    install_vllm(session)
    session.run(*PYTEST, "-m", "vllm", *session.posargs)


@nox.session(python=PYTHON)
def gpu(session: nox.Session) -> None:
    """GPU tests and the GPU benchmark; says so loudly and succeeds where there is no CUDA."""
    install(session)
    probe = "import torch; print(torch.cuda.is_available(), torch.version.cuda)"
    output = session.run("python", "-c", probe, silent=True)
    if output is None:  # nox --install-only: commands are not run
        return
    available, cuda_build = output.strip().splitlines()[-1].split()
    if available != "True":
        print("gpu: no CUDA device on this machine; GPU tests and benchmarks were NOT run")
        if cuda_build == "None":
            print(f"gpu: (the installed {TORCH} is a CPU-only build)")
        return
    session.run(*PYTEST, "-m", "gpu", *session.posargs)
    session.run("kvtier", "bench", "gpu")
