"""The build files agree with each other: the pins in requirements*.txt and environment.yml, the
torch pin the CPU machines rely on, the Makefile targets the README names, and what CI runs.

environment.yml is parsed by hand (PyYAML is not a pin of the lab): only its `- pip:` list matters.
"""
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PIN_FILES = ("requirements.txt", "requirements-cpu.txt")
TORCH_PIN = "2.13.0"  # the CPU wheel on the lab's machines; any other version downloads a CUDA build
DOCUMENTED_TARGETS = ("lab", "test", "gpu-check", "report", "app")


def _name(requirement):
    """PEP 503 normalised name: `Pytest_Timeout` and `pytest-timeout` are one package."""
    return re.sub(r"[-_.]+", "-", requirement).lower()


def _parse_pins(lines, source):
    """{name: version} from requirement lines `name==version[; marker]`; comments, blanks and
    options skipped (`_markers` reads the markers)."""
    pins = {}
    for line in lines:
        line = line.split("#", 1)[0].split(";", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        name, sep, version = line.partition("==")
        assert sep, f"{source}: {line!r} is not pinned with =="
        key = _name(name.strip())
        assert key not in pins, f"{source}: {key} is pinned twice"
        pins[key] = version.strip()
    return pins


def _markers(lines):
    """{name: environment marker} of the requirement lines that have one (`name==1.0; marker`)."""
    found = {}
    for line in lines:
        requirement, sep, marker = line.split("#", 1)[0].partition(";")
        if sep and not requirement.strip().startswith("-"):
            found[_name(requirement.partition("==")[0].strip())] = marker.strip()
    return found


def requirements_lines():
    return [line for filename in PIN_FILES for line in (ROOT / filename).read_text().splitlines()]


def requirements_pins():
    pins = {}
    for filename in PIN_FILES:
        lines = (ROOT / filename).read_text().splitlines()
        for key, version in _parse_pins(lines, filename).items():
            assert key not in pins, f"{key} is pinned in more than one of {PIN_FILES}"
            pins[key] = version
    return pins


def environment_pip_lines():
    """The items of environment.yml's `- pip:` list, as strings."""
    lines = (ROOT / "environment.yml").read_text().splitlines()
    items, indent = [], None
    for line in lines:
        stripped = line.strip()
        if indent is None:
            if stripped == "- pip:":
                indent = len(line) - len(line.lstrip())
            continue
        if not stripped or stripped.startswith("#"):
            continue
        if len(line) - len(line.lstrip()) <= indent:
            break  # back at the level of `- pip:`: the list has ended
        assert stripped.startswith("- "), f"environment.yml: unexpected line in the pip list: {line!r}"
        items.append(stripped[2:].strip())
    assert indent is not None, "environment.yml has no `- pip:` section"
    return items


def makefile_targets():
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, flags=re.MULTILINE))


def test_environment_yml_pins_match_requirements():
    reqs = requirements_pins()
    env = _parse_pins(environment_pip_lines(), "environment.yml")
    only_reqs = {k: v for k, v in reqs.items() if k not in env}
    only_env = {k: v for k, v in env.items() if k not in reqs}
    differ = {k: (reqs[k], env[k]) for k in reqs.keys() & env.keys() if reqs[k] != env[k]}
    assert not (only_reqs or only_env or differ), (
        f"environment.yml disagrees with {' + '.join(PIN_FILES)}: only in requirements {only_reqs}; "
        f"only in environment.yml {only_env}; versions (requirements, environment.yml) {differ}")


# Triton publishes wheels for Linux only (x86_64, aarch64), none for macOS or Windows: a pin
# without a marker would make the install fail there before the lab could start (issue 16).
TRITON_MARKER = 'sys_platform == "linux"'


@pytest.mark.parametrize("source", ["requirements", "environment.yml"])
def test_triton_is_installed_only_where_it_has_wheels(source):
    lines = requirements_lines() if source == "requirements" else environment_pip_lines()
    markers = _markers(lines)
    assert markers == {"triton": TRITON_MARKER}, (
        f"{source}: environment markers {markers}; triton needs exactly {TRITON_MARKER!r}, nothing else one")
    Marker = pytest.importorskip("packaging.markers").Marker
    for platform, wanted in (("linux", True), ("darwin", False), ("win32", False)):
        assert Marker(markers["triton"]).evaluate({"sys_platform": platform}) is wanted, platform


def test_environment_yml_installs_python_311_and_the_package():
    text = (ROOT / "environment.yml").read_text()
    assert re.search(r"^\s*-\s*python=3\.11\s*$", text, flags=re.MULTILINE), \
        "environment.yml does not ask for python=3.11 (the lab's CI python)"
    assert "-e ." in environment_pip_lines(), "environment.yml's pip list does not install the lab (`-e .`)"


def test_torch_is_pinned_to_the_local_cpu_wheel():
    version = requirements_pins().get("torch")
    assert version == TORCH_PIN, (
        f"torch is pinned to {version!r}, expected {TORCH_PIN!r}: "
        "only that CPU wheel is on the lab's disk; another version downloads a multi-GB CUDA build")


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib needs Python 3.11")
def test_lab_extra_lists_the_pinned_packages():
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_name(d) for d in project["dependencies"]}
    lab = {_name(d) for d in project["optional-dependencies"]["lab"]}
    pinned = set(requirements_pins()) - {"triton"}  # triton comes with torch; pinned only for CPU
    assert core == {"torch", "numpy"}, f"core dependencies should be torch and numpy, are {sorted(core)}"
    assert core | lab == pinned, (
        f"pyproject (core + lab) and requirements.txt disagree: only in pyproject {sorted((core | lab) - pinned)}, "
        f"only in requirements.txt {sorted(pinned - core - lab)}")


def test_makefile_has_the_documented_targets():
    missing = sorted(set(DOCUMENTED_TARGETS) - makefile_targets())
    assert not missing, f"Makefile lacks targets {missing} (found {sorted(makefile_targets())})"


def test_readme_make_commands_exist():
    readme = ROOT / "README.md"
    if not readme.exists():
        pytest.skip("no README.md yet")
    text = readme.read_text()
    # Only code counts (fenced blocks and `inline` spans): prose says "make sure".
    code = re.findall(r"```.*?```", text, flags=re.DOTALL) + re.findall(r"`[^`\n]+`", text)
    named = {m for c in code for m in re.findall(r"\bmake ([a-z][a-z0-9-]*)", c)}
    missing = sorted(named - makefile_targets())
    assert not missing, f"README.md mentions `make {missing[0]}`…, the Makefile lacks {missing}"


def test_ci_runs_make_test():
    script = (ROOT / ".ci" / "run").read_text()
    code = [line.split("#", 1)[0] for line in script.splitlines()]
    assert any(re.search(r"(^|[;&|]\s*)make\s+test\b", line.strip()) for line in code), \
        ".ci/run does not call `make test` (outside comments)"
