"""The wheel ships everything the packages read at run time: built from the working tree, installed
into a fresh virtual environment outside the checkout, it runs the README's adapter example."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kernels", "worker")
SYSTEM_TOOLS = {"make", "rabbitmq-server", "bash", "printf"}  # what a README command may start with besides .venv/bin/

pytestmark = pytest.mark.timeout(300)


def checkout_files() -> list[str]:
    """The files of the working tree that git tracks or would track (not ignored)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()
    return sorted(f for f in out.split("\0") if f and (ROOT / f).is_file())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built (pip wheel --no-deps --no-build-isolation) from a copy of the working tree."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for f in checkout_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True, capture_output=True, timeout=240)
    return next(out.glob("nllb_worker-*.whl"))


def test_wheel_holds_every_file_of_the_packages(wheel: Path) -> None:
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    package_files = [f for f in checkout_files() if f.split("/")[0] in PACKAGES]
    assert any(f.startswith("engine/assets/adapters/") for f in package_files)
    assert [f for f in package_files if f not in in_wheel] == []


def shell_commands(line: str) -> list[list[str]]:
    """The simple commands of one shell line (split at |, ;, &&), without variable assignments and
    redirections."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    redirect = False
    for word in lexer:
        if word in {"|", ";", "&&", "||", "&"}:
            commands.append([])
        elif word in {">", ">>", "<", "2>"}:
            redirect = True
        elif redirect:
            redirect = False
        elif commands[-1] or not re.match(r"^[A-Z_]+=", word):
            commands[-1].append(word)
    return [c for c in commands if c]


def test_readme_commands_run_as_written_from_the_checkout() -> None:
    """Every command of the README's shell blocks is `make`, a system tool, or a program of .venv/bin, and
    every `nllb-worker` command is one the CLI's own parser accepts (its subcommand and options exist)."""
    from worker.__main__ import build_parser

    readme = (ROOT / "README.md").read_text()
    commands = [words for block in re.findall(r"```sh\n(.*?)```", readme, re.S)
                for line in block.replace("\\\n", " ").splitlines() for words in shell_commands(line)]
    assert sum(words[0] == ".venv/bin/nllb-worker" for words in commands) >= 10
    for words in commands:
        assert words[0] in SYSTEM_TOOLS or words[0].startswith(".venv/bin/"), words
        assert (ROOT / words[0]).exists() or not words[0].startswith(".venv/"), words
        if words[0] == ".venv/bin/nllb-worker":
            try:
                build_parser().parse_args(words[1:])
            except SystemExit as e:
                raise AssertionError(f"nllb-worker refuses {shlex.join(words[1:])}") from e


def readme_adapter_example() -> list[tuple[str, str]]:
    """(command, expected output) pairs of the README's LoRA adapters example."""
    section = (ROOT / "README.md").read_text().split("## LoRA adapters", 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"```sh\n(.*?)```", section, re.S)[-1]
    lines = block.replace("\\\n", " ").splitlines()
    return [(cmd, out.removeprefix("# ")) for cmd, out in zip(lines[::2], lines[1::2])]


def test_readme_adapter_example_runs_from_an_install_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # the dependencies (torch, pydantic, aio-pika, ...) from the checkout's environment, after the venv's own
    Path(site, "checkout-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, capture_output=True, timeout=120)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NLLB_", "PYTHON"))}
    env["OMP_NUM_THREADS"] = "1"
    where = subprocess.run([str(python), "-c", "import engine, worker; print(engine.__file__, worker.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, check=True).stdout
    assert all(Path(p).is_relative_to(venv) for p in where.split()), where

    example = readme_adapter_example()
    assert any("--adapter" in cmd for cmd, _ in example)
    for cmd, want in example:
        words = shlex.split(cmd)
        assign = {w.split("=", 1)[0]: w.split("=", 1)[1] for w in words if re.match(r"^[A-Z_]+=", w)}
        argv = [w for w in words if w not in {f"{k}={v}" for k, v in assign.items()}]
        assert argv[0] == ".venv/bin/nllb-worker", cmd
        r = subprocess.run([str(venv / "bin" / "nllb-worker"), *argv[1:]], cwd=elsewhere, env={**env, **assign},
                           capture_output=True, text=True, timeout=120)
        assert (r.returncode, r.stdout.strip()) == (0, want), cmd + "\n" + r.stderr[-2000:]
