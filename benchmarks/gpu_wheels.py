"""The wheelhouse for gpu_check's stage A on a GPU machine with no network: which of scirl's requirements
its image holds and which travel as wheels (``benchmarks/gpu_wheels.txt``), and the checks that keep the
two lists whole.

    python3 benchmarks/gpu_wheels.py list         the wheel pins, one a line (gpu_wheels.sh downloads them)
    python3 benchmarks/gpu_wheels.py pyproject    every requirement of pyproject.toml: in the image or a wheel
    python3 benchmarks/gpu_wheels.py check DIR    the downloaded wheels: exactly the list, one version each,
                                                  every wheel's own requirements met; the total size and the
                                                  line that installs them there
    python3 benchmarks/gpu_wheels.py list-vllm | check-vllm DIR | record-vllm WHEEL
                                                  the same for stage B's vLLM set (gpu_wheels.sh --vllm)

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
VLLM_REQUIRES = HERE / "gpu_wheels_vllm_requires.txt"  # vLLM's Requires-Dist, as its wheel's METADATA states them
PART_BYTES = 54_000_000  # one part of the vLLM set: with the working tree, inside what one call carries
PYPROJECT = HERE.parent / "pyproject.toml"
# the machine's interpreter and platform, for requirement markers
MARKER_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "implementation_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}
MAX_TOTAL_MB = 64  # all that travels with one call to the machine, the working tree included


class ListError(ValueError):
    """A malformed line in the lists file: one line for the user."""


def parse_lists(path: Path = LISTS) -> dict[str, dict]:
    """Every kind of line: {"image": name -> version or None, "wheel": name -> pin, "vllm": name -> pin,
    "leave": name -> None}, names canonical; one kind per package."""
    kinds: dict[str, dict] = {"image": {}, "wheel": {}, "vllm": {}, "leave": {}, "waive": {}}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        kind, _, rest = line.partition(" ")
        fields = rest.split()
        where = f"{path.name}:{number}"
        if kind in ("image", "leave") and len(fields) in ((1, 2) if kind == "image" else (1,)):
            name, version = canonicalize_name(fields[0]), fields[1] if len(fields) == 2 else None
        elif kind in ("wheel", "vllm") and len(fields) == 1 and fields[0].count("==") == 1:
            name, version = (part.strip() for part in fields[0].split("=="))
            name = canonicalize_name(name)
        elif kind == "waive" and len(fields) == 2:  # keyed by (who, what): not a package of its own
            kinds["waive"][(canonicalize_name(fields[0]), canonicalize_name(fields[1]))] = None
            continue
        else:
            raise ListError(
                f"{where}: expected 'image NAME [VERSION]', 'wheel NAME==VERSION', 'vllm NAME==VERSION' "
                f"'leave NAME' or 'waive WHO NAME', got {raw.strip()!r}"
            )
        if name in kinds[kind]:
            what = "pinned" if kind in ("wheel", "vllm") else "listed"
            raise ListError(f"{where}: {name} is {what} twice (keep one version of each package)")
        kinds[kind][name] = version
    names = [name for kind, entries in kinds.items() if kind != "waive" for name in entries]
    doubled = sorted({name for name in names if names.count(name) > 1})
    if doubled:
        raise ListError(f"{path.name}: {', '.join(doubled)} listed under two kinds (keep one version of each)")
    return kinds


def read_lists(path: Path = LISTS) -> tuple[dict[str, str | None], dict[str, str]]:
    """(image: name -> version or None, stage A's wheels: name -> pinned version), names canonical."""
    kinds = parse_lists(path)
    return kinds["image"], kinds["wheel"]


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


def wheel_problems(
    directory: Path, pins: dict[str, str], image: dict, kinds: dict | None = None
) -> tuple[list[str], int]:
    """Problems of the wheels in ``directory`` against ``pins`` (exactly these, one version each, every wheel's
    own requirements met by the image or the pins, less what ``kinds`` leaves out or waives), and their size."""
    leave, waive = (kinds["leave"], kinds["waive"]) if kinds else ({}, {})
    problems, found, total = [], {}, 0
    for path in sorted(directory.glob("*.whl")):
        total += path.stat().st_size
        name, version, requires = wheel_metadata(path)
        if name in found:
            problems.append(f"{path.name}: a second wheel of {name} ({found[name]} is there too): keep one version")
        found[name] = version
        if name not in pins:
            problems.append(f"{path.name}: {name} is not in the wheel lists")
        elif pins[name] != version:
            problems.append(f"{path.name}: the lists pin {name}=={pins[name]}")
        kept = [
            text
            for text in requires
            if canonicalize_name(Requirement(text).name) not in leave
            and (name, canonicalize_name(Requirement(text).name)) not in waive
        ]
        problems += requirement_problems(kept, image, pins, f"{name} {version}")
    problems += [f"{name}=={version}: no wheel in {directory}" for name, version in pins.items() if name not in found]
    return problems, total


def wheelhouse_problems(directory: Path, lists: Path = LISTS, tree_bytes: int = 0) -> tuple[list[str], int]:
    """Problems of stage A's wheels in ``directory`` against the lists, and their total size in bytes; with
    ``tree_bytes`` of working tree beside them, whether both travel in one call."""
    image, wheels = read_lists(lists)
    problems, total = wheel_problems(directory, wheels, image)
    if total + tree_bytes > MAX_TOTAL_MB * 2**20:
        problems.append(
            f"the wheels take {total / 2**20:.1f} MiB and the working tree {tree_bytes / 2**20:.1f} MiB, "
            f"over the {MAX_TOTAL_MB} MiB that travel with a call"
        )
    return problems, total


def working_tree_bytes(repo: Path = HERE.parent) -> int:
    """What travels with a call besides the carried paths: the files git tracks or would track (ignored ones stay)."""
    import subprocess

    listed = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return sum((repo / name.decode()).stat().st_size for name in listed if name and (repo / name.decode()).is_file())


def vllm_requirement_problems(lists: Path = LISTS, requires: Path = VLLM_REQUIRES) -> list[str]:
    """vLLM's own requirements (``requires``, recorded from its wheel) that the image, the wheels and the vLLM
    set do not meet, leaving out those deliberately not carried (``leave``); and a ``leave`` vLLM does not ask."""
    kinds = parse_lists(lists)
    carried = {**kinds["wheel"], **kinds["vllm"]}
    wanted = [line for line in requires.read_text().splitlines() if line.strip() and not line.startswith("#")]
    asked = {canonicalize_name(Requirement(text).name) for text in wanted}
    kept = [text for text in wanted if canonicalize_name(Requirement(text).name) not in kinds["leave"]]
    problems = requirement_problems(kept, kinds["image"], carried, f"vllm {kinds['vllm'].get('vllm', '?')}")
    problems += [f"leave {name}: vLLM does not ask for it" for name in kinds["leave"] if name not in asked]
    return problems


def vllm_set_problems(directory: Path, lists: Path = LISTS) -> tuple[list[str], int]:
    """Problems of stage B's full set in ``directory`` (stage A's wheels and the vLLM set: exactly the pins,
    one version each, every wheel's own requirements met or left out on purpose), and its size in bytes."""
    kinds = parse_lists(lists)
    return wheel_problems(directory, {**kinds["wheel"], **kinds["vllm"]}, kinds["image"], kinds)


def pack(directory: Path, part_bytes: int = PART_BYTES) -> list[Path]:
    """The wheels in ``directory/wheels`` as one plain tar (wheels are zip files already), in a fixed order, cut
    into parts of at most ``part_bytes``, each in a folder of its own (``directory/part01``, ...), which also holds
    ``SET``: the whole tar's sha256 and the number of parts, so the install can tell a missing, foreign or
    corrupt part (``gpu_install_set.sh``). Earlier parts are removed first. Returns the part folders."""
    import hashlib
    import io
    import shutil
    import tarfile

    wheels = sorted((directory / "wheels").glob("*.whl"))
    if not wheels:
        raise ListError(f"no wheels in {directory / 'wheels'}")
    for old in directory.glob("part[0-9]*"):
        shutil.rmtree(old)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for wheel in wheels:
            info = tar.gettarinfo(str(wheel), arcname=wheel.name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""  # the same bytes every time
            with open(wheel, "rb") as f:
                tar.addfile(info, f)
    data = buffer.getvalue()
    digest, count = hashlib.sha256(data).hexdigest(), -(-len(data) // part_bytes)
    folders = []
    for i in range(count):
        folder = directory / f"part{i + 1:02d}"
        folder.mkdir()
        (folder / f"set.tar.{i + 1:02d}").write_bytes(data[i * part_bytes : (i + 1) * part_bytes])
        (folder / "SET").write_text(f"{digest} {count}\n")
        folders.append(folder)
    return folders


def install_line(directory: str) -> str:
    """The line that installs the wheels on the machine and puts them on the path (run in the repo's root there)."""
    site = f"{directory}/site"
    return (
        f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target {site} "
        f'{directory}/*.whl && export PYTHONPATH="$PWD/{site}${{PYTHONPATH:+:$PYTHONPATH}}"'
    )


USAGE = (
    "usage: gpu_wheels.py list | list-vllm | pyproject | check DIR | check-vllm DIR | pack DIR | record-vllm WHEEL\n"
    "  list, list-vllm     stage A's pins, stage B's (the vLLM set), one a line\n"
    "  pyproject           every requirement of pyproject.toml: in the image or a wheel\n"
    "  check DIR           stage A's downloaded wheels: complete, their requirements met, within one call\n"
    "  check-vllm DIR      both sets downloaded into DIR: complete, their requirements met or left out\n"
    "  pack DIR            DIR/wheels as parts of at most 54,000,000 bytes, DIR/part01 ... (one call carries one)\n"
    "  record-vllm WHEEL   write vLLM's Requires-Dist from its wheel to " + VLLM_REQUIRES.name
)


def main(argv: list[str]) -> int:
    takes_path = ("check", "check-vllm", "pack", "record-vllm")
    if (
        not argv
        or argv[0] not in ("list", "list-vllm", "pyproject", *takes_path)
        or (argv[0] in takes_path) != (len(argv) == 2)
        or len(argv) > 2
    ):
        print(USAGE, file=sys.stderr)
        return 2
    command = argv[0]
    try:
        if command in ("list", "list-vllm"):
            pins = parse_lists()["wheel" if command == "list" else "vllm"]
            print("\n".join(f"{name}=={version}" for name, version in pins.items()))
            return 0
        if command == "pyproject":
            problems = pyproject_problems()
            print("\n".join(problems) if problems else "pyproject.toml: every requirement is in the image or a wheel")
            return 1 if problems else 0
        path = Path(argv[1])
        if command == "record-vllm":
            name, version, requires = wheel_metadata(path)
            VLLM_REQUIRES.write_text(
                f"# Requires-Dist of {name} {version} (gpu_wheels.py record-vllm)\n" + "\n".join(requires) + "\n"
            )
            print(f"{VLLM_REQUIRES}: {len(requires)} requirements of {name} {version}")
            return 0
        if not path.is_dir():
            print(f"gpu_wheels.py: {path} is not a directory", file=sys.stderr)
            return 2
        if command == "pack":
            folders = pack(path)
            print(f"{len(folders)} parts of at most {PART_BYTES} bytes in {folders[0]} .. {folders[-1].name}")
            return 0
        if command == "check":
            tree = working_tree_bytes()
            problems, total = wheelhouse_problems(path, tree_bytes=tree)
            problems += pyproject_problems()
        else:
            problems, total = vllm_set_problems(path)
            problems += vllm_requirement_problems()
    except (ListError, OSError, zipfile.BadZipFile, InvalidRequirement) as e:
        print(f"gpu_wheels.py: {e}", file=sys.stderr)
        return 2
    for problem in problems:
        print(problem)
    count = len(list(path.glob("*.whl")))
    print(f"{count} wheels, {total / 2**20:.2f} MiB together ({'problems above' if problems else 'complete'})")
    if command == "check":
        print(
            f"with the working tree ({tree / 2**20:.2f} MiB): {(total + tree) / 2**20:.2f} MiB of the "
            f"{MAX_TOTAL_MB} MiB one call carries"
        )
    if problems:
        return 1
    if command == "check":
        print("install them on the GPU machine (in the repo's root there):")
        print("  " + install_line(argv[1].rstrip("/")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
