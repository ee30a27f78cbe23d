"""The package's layers import downward only (pyproject.toml's import-linter contracts, which CI
checks with ``lint-imports``), and the check catches an upward import."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytest.importorskip("importlinter")


def _lint(root: Path) -> subprocess.CompletedProcess:
    """lint-imports on the ``eaglet`` package under ``root`` (with the repository's contracts)."""
    return subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"],
                          cwd=root, env={"PYTHONPATH": str(root), "PATH": ""}, capture_output=True, text=True, timeout=300)


def _copy_package(dest: Path) -> None:
    shutil.copytree(REPO / "eaglet", dest / "eaglet", ignore=shutil.ignore_patterns("*.safetensors", "csrc", "__pycache__"))
    shutil.copy(REPO / "pyproject.toml", dest / "pyproject.toml")


def test_the_layer_contracts_hold(tmp_path):
    _copy_package(tmp_path)
    result = _lint(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("module", "imported", "message"), [
    ("kernels/__init__.py", "eaglet.engine.engine", "eaglet.kernels is not allowed to import eaglet.engine"),
    ("models/loader.py", "eaglet.spec.verify", "eaglet.models is not allowed to import eaglet.spec"),
    ("runtime/kv_cache.py", "eaglet.testing.checkpoints", "eaglet.runtime is not allowed to import eaglet.testing"),
])
def test_an_upward_import_breaks_a_contract(tmp_path, module, imported, message):
    _copy_package(tmp_path)
    planted = tmp_path / "eaglet" / module
    planted.write_text(planted.read_text() + f"\nimport {imported}  # planted\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert message in result.stdout
