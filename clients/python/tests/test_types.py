"""The package's annotations hold: mypy, in the strict mode `pyproject.toml` configures, finds nothing."""

from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def test_mypy_strict_passes_on_the_package(tmp_path):
    api = pytest.importorskip("mypy.api")
    stdout, stderr, status = api.run(
        [
            "--config-file", str(PACKAGE_ROOT / "pyproject.toml"),
            "--cache-dir", str(tmp_path / "mypy-cache"),
            "--show-error-codes",
            str(PACKAGE_ROOT / "draftpipe_client"),
        ]
    )
    assert status == 0, f"mypy --strict found problems (exit {status}):\n{stdout}{stderr}"
