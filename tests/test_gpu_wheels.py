"""The GPU machine's wheelhouse (``benchmarks/gpu_wheels.txt``): every requirement of pyproject.toml is
either in that machine's image or among the wheels ``benchmarks/gpu_wheels.sh`` downloads, so the list
cannot drift from the project's requirements. No network."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_wheels  # noqa: E402

sys.path.remove(str(REPO / "benchmarks"))


def test_every_pyproject_requirement_is_in_the_image_or_a_wheel():
    assert gpu_wheels.pyproject_problems() == []
    image, wheels = gpu_wheels.read_lists()
    # what the image lacks (stated for that machine): each one a wheel, pinned exactly
    for name in ("pydantic", "pydantic-core", "datasets", "dill", "multiprocess", "fastapi", "starlette", "uvicorn",
                 "tomli-w"):
        assert name in wheels and name not in image, name
        assert all(part.isdigit() for part in wheels[name].split(".")), (name, wheels[name])
    assert image["torch"] == "2.11.0" and image["transformers"] == "5.17.0"


def test_the_script_downloads_exactly_the_wheel_list():
    listed = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_wheels.py"), "list"], capture_output=True,
                            text=True, check=True).stdout.split()
    _, wheels = gpu_wheels.read_lists()
    assert listed == [f"{name}=={version}" for name, version in wheels.items()]
    script = (REPO / "benchmarks" / "gpu_wheels.sh").read_text()
    assert "gpu_wheels.py list" in script and "--python-version 3.12" in script and "--no-deps" in script


def test_a_requirement_outside_both_lists_or_off_a_known_version_is_a_problem():
    image, wheels = {"huggingface-hub": "1.33.0", "numpy": None}, {"pydantic": "2.13.5"}
    check = gpu_wheels.requirement_problems
    assert check(["numpy>=1.26", "pydantic>=2.7", "huggingface-hub<2,>=1.31"], image, wheels, "x") == []
    assert check(["tomli>=2.0; python_version < '3.11'", "pywin32; sys_platform == 'win32'"], image, wheels, "x") == []
    assert check(["scipy"], image, wheels, "x") == ["x needs 'scipy': neither in the image nor among the wheels"]
    assert check(["huggingface-hub<1.0"], image, wheels, "x") == [
        "x needs 'huggingface-hub<1.0': the image has huggingface-hub 1.33.0"]
    assert check(["pydantic>=2.14"], image, wheels, "x") == ["x needs 'pydantic>=2.14': the wheel has pydantic 2.13.5"]


def test_a_malformed_or_doubled_list_is_refused(tmp_path):
    lists = tmp_path / "lists.txt"
    for text, says in (("wheel pydantic>=2\n", "expected"), ("wheel a==1\nwheel a==2\n", "pinned twice"),
                       ("image a\nwheel a==1\n", "both in the image and a wheel")):
        lists.write_text(text)
        with pytest.raises(gpu_wheels.ListError, match=says):
            gpu_wheels.read_lists(lists)


@pytest.mark.skipif(not list((REPO / ".whl").glob("*.whl")), reason="no wheelhouse here (bash benchmarks/gpu_wheels.sh)")
def test_a_downloaded_wheelhouse_is_complete():
    """Where the wheels were downloaded: each one's own requirements are met, one version each, in the size limit."""
    problems, total = gpu_wheels.wheelhouse_problems(REPO / ".whl")
    assert problems == [] and total < gpu_wheels.MAX_TOTAL_MB * 2**20
