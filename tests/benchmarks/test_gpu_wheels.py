"""The GPU machine's wheelhouse (``benchmarks/gpu_wheels.txt``): every requirement of pyproject.toml is
either in that machine's image or among the wheels ``benchmarks/gpu_wheels.sh`` downloads, so the list
cannot drift from the project's requirements. No network."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_wheels  # noqa: E402

sys.path.remove(str(REPO / "benchmarks"))


def test_every_pyproject_requirement_is_in_the_image_or_a_wheel():
    assert gpu_wheels.pyproject_problems() == []
    image, wheels = gpu_wheels.read_lists()
    # what the image lacks (stated for that machine): each one a wheel, pinned exactly
    for name in (
        "pydantic",
        "pydantic-core",
        "datasets",
        "dill",
        "multiprocess",
        "fastapi",
        "starlette",
        "uvicorn",
        "tomli-w",
    ):
        assert name in wheels and name not in image, name
        assert all(part.isdigit() for part in wheels[name].split(".")), (name, wheels[name])
    assert image["torch"] == "2.11.0" and image["transformers"] == "5.17.0"


def test_the_script_downloads_exactly_the_wheel_list():
    listed = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_wheels.py"), "list"], capture_output=True, text=True, check=True
    ).stdout.split()
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
        "x needs 'huggingface-hub<1.0': the image has huggingface-hub 1.33.0"
    ]
    assert check(["pydantic>=2.14"], image, wheels, "x") == ["x needs 'pydantic>=2.14': the wheel has pydantic 2.13.5"]


def test_a_malformed_or_doubled_list_is_refused(tmp_path):
    lists = tmp_path / "lists.txt"
    for text, says in (
        ("wheel pydantic>=2\n", "expected"),
        ("wheel a==1\nwheel a==2\n", "pinned twice"),
        ("image a\nwheel a==1\n", "listed under two kinds"),
    ):
        lists.write_text(text)
        with pytest.raises(gpu_wheels.ListError, match=says):
            gpu_wheels.read_lists(lists)


def test_trl_travels_with_stage_as_wheels():
    """The peer benchmark's transformers pair runs in stage A's call: TRL (pure Python) is one of its wheels, and what
    it needs is in the image or among them (its Requires-Dist of 1.16.0, extras left out)."""
    image, wheels = gpu_wheels.read_lists()
    assert wheels["trl"] == "1.16.0" and "trl" not in gpu_wheels.parse_lists()["vllm"]
    trl_requires = [
        "accelerate>=1.10.1",
        "datasets>=4.7.0",
        "huggingface_hub>=0.34.0",
        "jinja2",
        "numpy>=1.26.0",
        "packaging>20.0",
        "pandas>=2.1.1",
        "psutil>=5.9.4",
        "pyarrow>=21.0.0",
        "pyyaml>=6.0.1",
        "transformers>=4.56.2",
        'liger-kernel>=0.8.2; extra == "liger"',
    ]
    assert gpu_wheels.requirement_problems(trl_requires, image, wheels, "trl") == []


def test_the_wheels_and_the_working_tree_must_fit_one_call_together(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    tiny_wheel(wheels, "alpha_pkg")
    limit = gpu_wheels.MAX_TOTAL_MB * 2**20
    _, total = gpu_wheels.wheelhouse_problems(wheels, tree_bytes=0)
    over, _ = gpu_wheels.wheelhouse_problems(wheels, tree_bytes=limit - total + 1)
    fits, _ = gpu_wheels.wheelhouse_problems(wheels, tree_bytes=limit - total)
    assert [p for p in over if "travel with a call" in p] and not [p for p in fits if "travel with a call" in p]
    assert 0 < gpu_wheels.working_tree_bytes() < limit // 4  # the repository itself: a few MiB


@pytest.mark.skipif(
    not list((REPO / ".whl").glob("*.whl")), reason="no wheelhouse here (bash benchmarks/gpu_wheels.sh)"
)
def test_a_downloaded_wheelhouse_is_complete():
    """Where the wheels were downloaded: each one's own requirements are met, one version each, and they travel in one
    call with the working tree."""
    problems, total = gpu_wheels.wheelhouse_problems(REPO / ".whl", tree_bytes=gpu_wheels.working_tree_bytes())
    assert problems == [] and total < gpu_wheels.MAX_TOTAL_MB * 2**20


def tiny_wheel(directory: Path, name: str) -> Path:
    """A real, installable pure-Python wheel of one module ``name`` that sets ``VALUE = name``."""
    import base64
    import hashlib
    import zipfile

    files = {
        f"{name}.py": f"VALUE = {name!r}\n",
        f"{name}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
        f"{name}-1.0.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = [
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
        f"{len(text.encode())}"
        for path, text in files.items()
    ]
    files[f"{name}-1.0.dist-info/RECORD"] = "\n".join(record + [f"{name}-1.0.dist-info/RECORD,,"]) + "\n"
    path = directory / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in files.items():
            archive.writestr(member, text)
    return path


def install_set(*args, store: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_install_set.sh"), *args],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "SCIRL_SET_STORE": str(store)},
    )


@pytest.mark.slow
def test_the_set_travels_in_parts_and_installs_only_whole(tmp_path):
    """``pack`` cuts the wheels into parts of at most the given size, each with the set's checksum; the install
    refuses a missing, foreign or corrupt part in one line (exit 2) and installs a whole set, importable."""
    set_dir = tmp_path / "set"
    (set_dir / "wheels").mkdir(parents=True)
    for name in ("alpha_pkg", "beta_pkg", "gamma_pkg"):
        tiny_wheel(set_dir / "wheels", name)
    parts = gpu_wheels.pack(set_dir, part_bytes=4000)
    assert len(parts) >= 3 and all((p / "SET").is_file() for p in parts)
    assert all(f.stat().st_size <= 4000 for p in parts for f in p.glob("set.tar.*"))
    assert gpu_wheels.PART_BYTES == 54_000_000  # one part and the working tree inside the 64 MiB a call carries

    store = tmp_path / "store"
    for part in parts[:-1]:
        assert install_set("--receive", str(part), store=store).returncode == 0
    missing = install_set("--install", store=store)
    assert missing.returncode == 2 and f"{len(parts) - 1} of {len(parts)} parts" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
    assert install_set("--receive", str(parts[-1]), store=store).returncode == 0

    corrupt = tmp_path / "corrupt"  # the same set's last part, one byte changed
    corrupt.mkdir()
    (corrupt / "SET").write_text((parts[-1] / "SET").read_text())
    last = next(parts[-1].glob("set.tar.*"))
    data = bytearray(last.read_bytes())
    data[0] ^= 1
    (corrupt / last.name).write_bytes(bytes(data))
    bad_store = tmp_path / "bad-store"
    for part in [*parts[:-1], corrupt]:
        install_set("--receive", str(part), store=bad_store)
    refused = install_set("--install", store=bad_store)
    assert refused.returncode == 2 and "checksum" in refused.stderr

    foreign = tmp_path / "foreign"
    (foreign / "wheels").mkdir(parents=True)
    tiny_wheel(foreign / "wheels", "delta_pkg")
    other = gpu_wheels.pack(foreign, part_bytes=4000)
    mixed_store = tmp_path / "mixed"
    for part in [*parts[:-1], other[-1]]:
        install_set("--receive", str(part), store=mixed_store)
    assert install_set("--install", store=mixed_store).returncode == 2

    site = tmp_path / "site"
    done = install_set("--install", str(site), store=store)
    assert done.returncode == 0, done.stderr
    imported = subprocess.run(
        [sys.executable, "-c", "import alpha_pkg, gamma_pkg; print(alpha_pkg.VALUE, gamma_pkg.VALUE)"],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(site)},
    )
    assert imported.stdout.split() == ["alpha_pkg", "gamma_pkg"]


def test_vllms_own_requirements_are_met_or_left_out_on_purpose():
    """Every requirement vLLM 0.25.0's wheel states (recorded in gpu_wheels_vllm_requires.txt) is in the image, a
    wheel or the vLLM set at a version it accepts, or deliberately left out with its reason."""
    assert gpu_wheels.vllm_requirement_problems() == []
    kinds = gpu_wheels.parse_lists()
    assert kinds["vllm"]["vllm"] == "0.25.0" and kinds["wheel"]["trl"] == "1.16.0"  # TRL: among stage A's
    assert (
        "flashinfer-python" in kinds["leave"]
    )  # hence VLLM_USE_FLASHINFER_SAMPLER=0 (scirl.inference.vllm.sampler_env)
    recorded = (REPO / "benchmarks" / "gpu_wheels_vllm_requires.txt").read_text()
    assert "torch==2.11.0" in recorded  # the image's torch: why 0.25 and not a later release


@pytest.mark.skipif(
    not list((REPO / ".vllm-set" / "wheels").glob("*.whl")),
    reason="no vLLM set here (bash benchmarks/gpu_wheels.sh --vllm)",
)
def test_a_downloaded_vllm_set_is_complete():
    problems, total = gpu_wheels.vllm_set_problems(REPO / ".vllm-set" / "wheels")
    assert problems == [] and total > 0
