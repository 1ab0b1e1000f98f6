"""The wheelhouse for gpu_check's stage A on a GPU machine with no network: which of scirl's requirements
its image holds and which travel as wheels (``benchmarks/gpu_wheels.txt``), and the checks that keep the
two lists whole.

    python3 benchmarks/gpu_wheels.py list         the wheel pins, one a line (gpu_wheels.sh downloads them)
    python3 benchmarks/gpu_wheels.py pyproject    every requirement of pyproject.toml: in the image or a wheel
    python3 benchmarks/gpu_wheels.py check DIR    the downloaded wheels: exactly the list, one version each,
                                                  every wheel's own requirements met; the total size and the
                                                  line that installs them there

Requirements are evaluated for the machine: CPython 3.12.3 on Linux x86-64, no extras.
"""

from __future__ import annotations

import sys
import zipfile
from email.parser import Parser
from pathlib import Path

try:
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # a bare python3 that only has pip: the same library, vendored
    from pip._vendor.packaging.requirements import InvalidRequirement, Requirement
    from pip._vendor.packaging.utils import canonicalize_name

HERE = Path(__file__).resolve().parent
LISTS = HERE / "gpu_wheels.txt"
PYPROJECT = HERE.parent / "pyproject.toml"
# the machine's interpreter and platform, for requirement markers
MARKER_ENV = {
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "implementation_version": "3.12.3", "sys_platform": "linux",
    "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix", "extra": "",
}
MAX_TOTAL_MB = 64  # all that travels with one call to the machine, the working tree included


class ListError(ValueError):
    """A malformed line in the lists file: one line for the user."""


def read_lists(path: Path = LISTS) -> tuple[dict[str, str | None], dict[str, str]]:
    """(image: name -> version or None, wheels: name -> pinned version), names canonical."""
    image: dict[str, str | None] = {}
    wheels: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        kind, _, rest = line.partition(" ")
        fields = rest.split()
        where = f"{path.name}:{number}"
        if kind == "image" and len(fields) in (1, 2):
            name = canonicalize_name(fields[0])
            if name in image:
                raise ListError(f"{where}: {fields[0]} is listed twice as an image package")
            image[name] = fields[1] if len(fields) == 2 else None
        elif kind == "wheel" and len(fields) == 1 and fields[0].count("==") == 1:
            name, version = (part.strip() for part in fields[0].split("=="))
            name = canonicalize_name(name)
            if name in wheels:
                raise ListError(f"{where}: {name} is pinned twice (keep one version of each package)")
            wheels[name] = version
        else:
            raise ListError(f"{where}: expected 'image NAME [VERSION]' or 'wheel NAME==VERSION', got {raw.strip()!r}")
    both = sorted(set(image) & set(wheels))
    if both:
        raise ListError(f"{path.name}: {', '.join(both)} both in the image and a wheel (keep one version of each)")
    return image, wheels


def requirement_problems(requirements: list[str], image: dict, wheels: dict, who: str) -> list[str]:
    """What in ``requirements`` (requirement strings of ``who``) the image and the wheels do not meet on the machine."""
    problems = []
    for text in requirements:
        try:
            req = Requirement(text)
        except InvalidRequirement as e:
            problems.append(f"{who}: unreadable requirement {text!r}: {e}")
            continue
        if req.marker is not None and not req.marker.evaluate(MARKER_ENV):
            continue  # another Python, platform or an extra
        name = canonicalize_name(req.name)
        if name in wheels:
            version, where = wheels[name], "the wheel"
        elif name in image:
            version, where = image[name], "the image"
        else:
            problems.append(f"{who} needs {text!r}: neither in the image nor among the wheels")
            continue
        if version is not None and req.specifier and not req.specifier.contains(version, prereleases=True):
            problems.append(f"{who} needs {text!r}: {where} has {name} {version}")
    return problems


def pyproject_requirements(path: Path = PYPROJECT) -> list[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    return tomllib.loads(path.read_text())["project"]["dependencies"]


def pyproject_problems(lists: Path = LISTS, pyproject: Path = PYPROJECT) -> list[str]:
    image, wheels = read_lists(lists)
    return requirement_problems(pyproject_requirements(pyproject), image, wheels, "scirl")


def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """(canonical name, version, Requires-Dist) of a wheel file."""
    with zipfile.ZipFile(path) as archive:
        names = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        if len(names) != 1:
            raise ListError(f"{path.name}: not a wheel (no single *.dist-info/METADATA)")
        meta = Parser().parsestr(archive.read(names[0]).decode("utf-8"))
    return canonicalize_name(meta["Name"]), meta["Version"], meta.get_all("Requires-Dist") or []


def wheelhouse_problems(directory: Path, lists: Path = LISTS) -> tuple[list[str], int]:
    """Problems of the wheels in ``directory`` against the lists, and their total size in bytes."""
    image, wheels = read_lists(lists)
    problems, found, total = [], {}, 0
    for path in sorted(directory.glob("*.whl")):
        total += path.stat().st_size
        name, version, requires = wheel_metadata(path)
        if name in found:
            problems.append(f"{path.name}: a second wheel of {name} ({found[name]} is there too): keep one version")
        found[name] = version
        if name not in wheels:
            problems.append(f"{path.name}: {name} is not in the wheel list")
        elif wheels[name] != version:
            problems.append(f"{path.name}: the list pins {name}=={wheels[name]}")
        problems += requirement_problems(requires, image, wheels, f"{name} {version}")
    problems += [f"{name}=={version}: no wheel in {directory}" for name, version in wheels.items() if name not in found]
    if total > MAX_TOTAL_MB * 2**20:
        problems.append(f"the wheels take {total / 2**20:.1f} MiB, over the {MAX_TOTAL_MB} MiB that travel with a call")
    return problems, total


def install_line(directory: str) -> str:
    """The line that installs the wheels on the machine and puts them on the path (run in the repo's root there)."""
    site = f"{directory}/site"
    return (f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target {site} "
            f"{directory}/*.whl && export PYTHONPATH=\"$PWD/{site}${{PYTHONPATH:+:$PYTHONPATH}}\"")


def main(argv: list[str]) -> int:
    usage = "usage: gpu_wheels.py list | pyproject | check DIR"
    if not argv or argv[0] not in ("list", "pyproject", "check") or (argv[0] == "check") != (len(argv) == 2) \
            or len(argv) > 2:
        print(usage, file=sys.stderr)
        return 2
    try:
        if argv[0] == "list":
            print("\n".join(f"{name}=={version}" for name, version in read_lists()[1].items()))
            return 0
        if argv[0] == "pyproject":
            problems = pyproject_problems()
            print("\n".join(problems) if problems else "pyproject.toml: every requirement is in the image or a wheel")
            return 1 if problems else 0
        directory = Path(argv[1])
        if not directory.is_dir():
            print(f"gpu_wheels.py: {directory} is not a directory", file=sys.stderr)
            return 2
        problems, total = wheelhouse_problems(directory)
        problems += pyproject_problems()
    except (ListError, OSError, zipfile.BadZipFile) as e:
        print(f"gpu_wheels.py: {e}", file=sys.stderr)
        return 2
    for problem in problems:
        print(problem)
    count = len(list(directory.glob("*.whl")))
    print(f"{count} wheels, {total / 2**20:.2f} MiB together ({'problems above' if problems else 'complete'})")
    if problems:
        return 1
    print("install them on the GPU machine (in the repo's root there):")
    print("  " + install_line(argv[1].rstrip("/")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
