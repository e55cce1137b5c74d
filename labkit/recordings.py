"""Measured data that describes itself: every recording carries its provenance (device,
software versions, date, command, git commit), and no recording is ever overwritten.

    write_recording("data", "decode-sweep-cpu", {"phase": "decode", "points": [...]})
    # -> data/decode-sweep-cpu.json, or data/decode-sweep-cpu-2.json if that exists
    load_recordings("data", phase="decode")

Files are written whole or not at all (a temporary file in the same directory, then a link or
rename), so a crash mid-write never leaves half a JSON file where a notebook will read it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import socket
import sys
import tempfile
import warnings
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from .cpu_info import run_command, usable_cores
from .errors import LabError
from .units import machine_name

REQUIRED_PROVENANCE = ("device", "date")
_REPO = Path(__file__).resolve().parent.parent


def provenance(device: str, command: str | None = None) -> dict:
    """Where and how a measurement was made. `command` defaults to this process's argv."""
    import torch  # here, not at the top: reading recordings should not need torch

    from .backend import device_name  # backend imports torch too

    kind = torch.device(getattr(device, "device", device)).type
    commit = git_commit()
    return {
        "device": kind, "device_name": device_name(kind),
        "driver": _nvidia_driver() if kind == "cuda" else None,
        "cuda_runtime": torch.version.cuda, "torch": torch.__version__,
        "triton": _version("triton") or _version("pytorch-triton"), "numpy": _version("numpy"),
        "python": platform.python_version(), "platform": platform.platform(),
        "hostname": socket.gethostname(), "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        # the cores this process could use (an affinity mask, a cgroup's quota: a container, a hub)
        "usable_cores": usable_cores(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv) if command is None else command,
        "git_commit": commit,
        # what differed from it there is not known for a copied tree named by LABKIT_GIT_COMMIT
        "git_changed_files": None if commit is None or os.environ.get("LABKIT_GIT_COMMIT") else _git_changed_files(),
    }


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _nvidia_driver() -> str | None:
    """The kernel driver's version: /proc has it without running anything; else nvidia-smi."""
    try:
        first = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
        return next(word for word in first.split() if word[:1].isdigit() and "." in word)
    except (OSError, IndexError, StopIteration):
        pass
    out = run_command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None


def git_commit() -> str | None:
    """HEAD of the repository, or LABKIT_GIT_COMMIT where the tree travelled without its .git
    (a copy sent to a GPU machine: set it to `git rev-parse HEAD` of the checkout it came from)."""
    return os.environ.get("LABKIT_GIT_COMMIT") or run_command(["git", "-C", str(_REPO), "rev-parse", "HEAD"])


def _git_changed_files() -> list[str]:
    """The tracked files that differ from HEAD where the measurement ran ([]: none), so a figure
    taken with uncommitted changes says so beside its commit."""
    changed = run_command(["git", "-C", str(_REPO), "status", "--porcelain", "--untracked-files=no"])
    return [line.split(maxsplit=1)[-1] for line in changed.splitlines()] if changed else []


def to_json(value):
    """`json.dump`'s fallback for what JSON lacks: dataclasses, numpy/torch numbers, paths, dtypes."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if hasattr(value, "tolist"):  # numpy and torch scalars and arrays
        return value.tolist()
    return str(value)  # Path, torch.dtype, torch.device


def _temp_json(directory: Path, obj) -> Path:
    """`obj` as JSON in a fully written, fsynced temporary file in `directory`."""
    fd, temp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=directory)
    try:
        os.chmod(temp, 0o644)  # mkstemp makes it private; a recording is for everyone to read
        with os.fdopen(fd, "w") as file:
            json.dump(obj, file, indent=1, default=to_json)
            file.write("\n")
            file.flush()
            os.fsync(file.fileno())
    except BaseException:
        os.unlink(temp)
        raise
    return Path(temp)


def write_json_atomic(path: str | Path, obj) -> Path:
    """Write `obj` as JSON to `path`, replacing it in one step: readers see old or new, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = _temp_json(path.parent, obj)
    try:
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)  # only still there if the rename failed
    return path


def check_writable(directory: str | Path) -> Path:
    """`directory`, created if missing, once a file could be written in it and removed again; else a
    LabError that says why. Called before a run measures anything (`bench`, the GPU check), so an
    unwritable folder costs a line, not a measured run that cannot be kept."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".tmp-probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise LabError(f"cannot write recordings in {str(directory)!r}: {err.strerror or err}") from None
    return directory


def write_recording(directory: str | Path, name: str, payload: dict) -> Path:
    """Write {"provenance": ..., **payload} to directory/name.json, or name-2.json, name-3.json ...
    if taken: never overwrites, even with another process writing the same name at once.
    Provenance is payload["provenance"] if given, else `provenance(payload["device"])`."""
    directory, name = Path(directory), _check_name(name)
    record = {"provenance": _record_provenance(payload),
              **{k: v for k, v in payload.items() if k != "provenance"}}
    directory.mkdir(parents=True, exist_ok=True)
    temp = _temp_json(directory, record)
    try:
        for n in range(1, 10_000):
            target = directory / (f"{name}.json" if n == 1 else f"{name}-{n}.json")
            if _claim(temp, target):
                return target
    finally:
        temp.unlink(missing_ok=True)
    raise LabError(f"{directory} already holds 9,999 recordings called {name!r}; choose another name")


def _check_name(name: str) -> str:
    name = name[:-5] if name.endswith(".json") else name
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise LabError(f"recording name {name!r} must be a plain file name (no slashes, not hidden)")
    return name


def _record_provenance(payload: dict) -> dict:
    given = payload.get("provenance")
    if given is None:
        if "device" not in payload:
            raise LabError("a recording needs a 'device' (or a 'provenance' dict) in its payload")
        given = provenance(payload["device"])
    missing = [key for key in REQUIRED_PROVENANCE if key not in given]
    if missing:
        raise LabError(f"recording provenance lacks {', '.join(missing)}")
    return dict(given)


def _claim(temp: Path, target: Path) -> bool:
    """Give the finished temp file the name `target` unless it exists. A hard link fails if the
    name is taken, atomically; where links are unsupported, O_EXCL reserves the name first."""
    try:
        os.link(temp, target)
        return True
    except FileExistsError:
        return False
    except OSError:  # no hard links here (some network or FUSE file systems)
        try:
            os.close(os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        try:
            os.replace(temp, target)
        except BaseException:  # never leave the reserved, empty name behind as a broken recording
            target.unlink(missing_ok=True)
            raise
        return True


class Recordings(list):
    """A list of recordings (dicts) that also says which files were skipped, and why."""

    def __init__(self, records=(), skipped=()):
        super().__init__(records)
        self.skipped: list[tuple[str, str]] = list(skipped)  # (path, reason)


def load_recordings(directory: str | Path, phase: str | None = None) -> Recordings:
    """Every readable *.json in `directory` (sorted by name) with a provenance, each with its
    file name under "_path"; only those whose "phase" equals `phase` if given. Unreadable files
    are skipped with a warning and listed in `.skipped`."""
    records, skipped = [], []
    for path in sorted(Path(directory).glob("*.json")):
        if path.name.startswith("."):  # a write in progress (see _temp_json)
            continue
        try:
            record = json.loads(path.read_text())
            _check_record(record)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, LabError) as err:
            skipped.append((str(path), str(err)))
            warnings.warn(f"labkit: skipped recording {path}: {err}", stacklevel=2)
            continue
        if phase is None or record.get("phase") == phase:
            records.append({**record, "_path": str(path)})
    return Recordings(records, skipped)


def _check_record(record) -> None:
    if not isinstance(record, dict) or not isinstance(record.get("provenance"), dict):
        raise LabError("not a recording (no 'provenance' object)")
    missing = [key for key in REQUIRED_PROVENANCE if key not in record["provenance"]]
    if missing:
        raise LabError(f"provenance lacks {', '.join(missing)}")


def gpu_decode_points(directory) -> tuple[list[dict], str]:
    """Decode points of the newest GPU recording in `directory` (a gpu_check output), and a label
    naming its hardware and date; ([], why not) when there is none."""
    if not Path(directory).is_dir():
        return [], f"no recordings folder at {directory}"
    found = [rec for rec in load_recordings(directory, phase="decode")
             if rec["provenance"].get("device") == "cuda" and rec.get("points")]
    if not found:
        return [], f"no GPU decode recording in {directory} yet (run `make gpu-check` on a GPU machine)"
    newest = max(found, key=lambda rec: rec["provenance"]["date"])
    timed = [p for p in newest["points"] if "time_s" in p]  # refused points carry "skipped" instead
    dtype = "bf16" if any(p.get("cache_dtype") == "bf16" for p in timed) else (timed or [{}])[0].get("cache_dtype")
    # gpu_check measures its batches at one context (and batch 1 at others): keep that row, a grid
    # `batching.step_time_from_records` can read; the cache term is then held at that context.
    contexts = [p["context_tokens"] for p in timed if p.get("cache_dtype") == dtype]
    if not contexts:
        return [], f"the newest GPU decode recording in {directory} has no timed points"
    context = max(set(contexts), key=contexts.count)
    points = [{**p, "device": "cuda", "device_name": newest["provenance"].get("device_name", "cuda")}
              for p in timed if p.get("cache_dtype") == dtype and p["context_tokens"] == context]
    label = (f"{machine_name(newest['provenance'].get('device_name', 'GPU'))}, recorded {newest['provenance']['date'][:10]}, "
             f"{dtype} cache at {context:,} tokens")
    return points, label
