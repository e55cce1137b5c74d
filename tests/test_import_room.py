"""labkit.import_room: under a memory limit with no room to load torch, `import labkit` refuses in
one line (a notebook cell, the CLI), before torch loads, instead of the OOM killer ending a kernel."""
import subprocess
import sys

import pytest

from labkit import import_room
from labkit.errors import FootprintError

GIB, MIB = 2**30, 2**20
ROOT = import_room.__file__.rsplit("/labkit/", 1)[0]


def test_a_limit_with_less_free_than_the_import_takes_is_refused_naming_what_to_stop():
    with pytest.raises(FootprintError) as caught:
        import_room.check_room_to_import([(8 * GIB, GIB), (2 * GIB, 2 * GIB - 200 * MIB)])
    assert str(caught.value) == (
        "this server's 2.0 GiB memory limit has 200 MiB free, and loading PyTorch and the lab takes about 300 MiB; "
        "1.8 GiB is in use, most often by the kernels of lessons still open: shut down those you have finished "
        "(Kernel > Shut Down Kernel, or close their tabs), then run this again")
    import_room.check_room_to_import([(2 * GIB, 2 * GIB - import_room.IMPORT_BYTES)])  # just enough
    import_room.check_room_to_import([(2 * GIB, None), (1 << 62, 0)])  # usage unreadable; a huge limit
    import_room.check_room_to_import([])  # no limits: nothing checked


# A fresh process whose cgroup (read by labkit.cgroups) leaves 200 MiB of a 2 GiB limit free.
FAKE_LIMIT = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("labkit.cgroups", {ROOT!r} + "/labkit/cgroups.py")
cgroups = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cgroups)
cgroups.memory_limits = lambda *args, **kwargs: [(2 << 30, (2 << 30) - (200 << 20))]
sys.modules["labkit.cgroups"] = cgroups
"""


def run_fresh(code: str, limited: bool = True) -> subprocess.CompletedProcess:
    """`code` in a fresh Python, under the fake limit (or this machine's own)."""
    prelude = FAKE_LIMIT if limited else "import sys\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def test_a_lesson_cell_importing_labkit_shows_one_line_and_loads_no_torch():
    pytest.importorskip("IPython")
    done = run_fresh("from IPython.core.interactiveshell import InteractiveShell\n"
                     "result = InteractiveShell.instance().run_cell('from labkit import backend, sweeps')\n"
                     "print('torch loaded:', 'torch' in sys.modules, type(result.error_in_exec).__name__)\n")
    shown = [line for line in done.stdout.splitlines() if line.strip()]
    assert done.returncode == 0, done.stderr
    assert len(shown) == 2 and shown[0].startswith("FootprintError: this server's 2.0 GiB memory limit has 200 MiB free")
    assert shown[1] == "torch loaded: False FootprintError"


def test_the_cli_says_it_in_one_line_and_exits_2_where_a_command_loads_torch():
    """`python -m labkit ...`: a measurement is refused in one line (exit 2); listing the presets
    loads no torch and runs."""
    run = "import runpy\nsys.argv = ['-m', {}]\nruntime = runpy.run_module('labkit', run_name='__main__', alter_sys=True)\n"
    done = run_fresh(run.format("'measure', 'decode', '--batch', '1', '--context', '16'"))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("labkit: error: this server's 2.0 GiB memory limit has 200 MiB free")
    assert done.stderr.count("\n") == 1
    listed = run_fresh(run.format("'models'"))
    assert listed.returncode == 0 and "lab-cpu" in listed.stdout, listed.stderr


def test_with_torch_loaded_first_there_is_nothing_left_to_refuse():
    done = run_fresh("import torch, labkit\nprint('imported')\n")
    assert done.returncode == 0 and done.stdout.strip() == "imported", done.stderr


def test_what_never_loads_torch_is_never_refused_and_a_refused_import_can_be_run_again():
    """Only torch's import is checked: lesson 08's modules (formulas, the quiz), `make lab`'s
    launcher and `make update` load under a full limit; `import torch` is refused, and refused again
    when run again while the limit is still full."""
    code = ("import labkit.launch, labkit.update\nfrom labkit import quiz, roofline, specs, views\n"
            "print('loaded, torch:', 'torch' in sys.modules)\n"
            "for attempt in range(2):\n"
            "    try:\n        from labkit import sweeps\n    except Exception as error:\n"
            "        print(type(error).__name__, 'torch:', 'torch' in sys.modules)\n")
    done = run_fresh(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["loaded, torch: False", "FootprintError torch: False",
                                        "FootprintError torch: False"]


def test_with_room_torch_loads_and_the_check_steps_aside():
    done = run_fresh("import labkit, torch\nfrom labkit import import_room\n"
                     "print(import_room.TorchImportCheck in sys.meta_path)\n", limited=False)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr


def test_a_script_shows_an_uncaught_refusal_as_one_line():
    done = run_fresh("import labkit\nimport torch\n")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("labkit: error: this server's 2.0 GiB memory limit has 200 MiB free")
    assert done.stderr.count("\n") == 1


def test_asking_whether_torch_is_installed_is_answered_not_refused():
    """A library's `importlib.util.find_spec("torch")` loads nothing: it gets torch's spec under a
    full limit, and the import that follows is still refused."""
    done = run_fresh("import importlib.util, labkit\nspec = importlib.util.find_spec('torch')\n"
                     "print(spec is not None and spec.name)\n"
                     "try:\n    import torch\nexcept Exception as error:\n    print(type(error).__name__)\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["torch", "FootprintError"]
