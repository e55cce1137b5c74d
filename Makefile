# Prefill vs decode lab. `make help` lists the targets; `make test` is what CI runs (.ci/run).
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV      := .venv
PY        := $(VENV)/bin/python
STAMP     := $(VENV)/.stamp
WARM      := $(VENV)/.warm
# The lab's JupyterLab defaults (labkit/launch.py's LAB_DEFAULTS and SERVER_DEFAULTS), which `python -m labkit.launch --install-defaults` copies into the venv
DEFAULTS  := share/jupyter/lab/settings/overrides.d/prefill-decode-lab.json etc/jupyter/jupyter_server_config.d/prefill-decode-lab.json
PORT      ?= 8888
NB        ?= notebooks/01_two_phases.ipynb
OUT       ?= build/gpu-check
PARAMS    ?=
REPORT    := build/report
CHROMIUM  := /usr/bin/chromium
NOTEBOOKS := $(wildcard notebooks/*.ipynb)
TRITON    ?=
TARGETS   ?=
TRITON_VENV := build/venv-triton$(TRITON)
# Triton made absent, as on macOS and Windows (it publishes no wheels there): the blocker in
# tests/no_triton/sitecustomize.py comes first on PYTHONPATH (test-no-triton).
NO_TRITON := PYTHONPATH="$(CURDIR)/tests/no_triton$${PYTHONPATH:+:$$PYTHONPATH}"
# The tests that drive a browser or a server (JupyterLab, Voila, papermill's report) run one at a
# time: they time lessons on the machine's cores, and so do the tests marked `timed` (a relation between
# real timings). The others run in TEST_JOBS processes (pytest-xdist; a core each, at most 4, none on
# one core) and on a GPU machine in one, whose tests time kernels on its one GPU.
SERIAL_TESTS := tests/test_app.py tests/test_browser.py tests/test_make_lab.py tests/test_report.py
TEST_JOBS ?= $(shell if nvidia-smi >/dev/null 2>&1; then echo 0; \
                     else $(PY) -c 'import os; n = min(os.cpu_count() or 1, 4); print(n if n > 1 else 0)'; fi)

# A token for lab/app: the caller's JUPYTER_TOKEN, else a fresh random one (never empty).
TOKEN_SH = token="$${JUPYTER_TOKEN:-$$($(PY) -c 'import secrets; print(secrets.token_urlsafe(24))')}"

.PHONY: help venv browser lab update keep test test-no-triton gpu-check gpu-compile bench report app strip clean

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "} {printf "  %-15s %s\n", $$1, $$2}'

venv: $(STAMP) $(WARM) $(VENV)/.defaults ## (internal) Create .venv and install the pins (reruns when requirements*.txt or pyproject.toml change); compile the CPU step's kernels

# Without a GPU: the pins plus requirements-cpu.txt (CPU torch 2.13.0; triton 3.9.0 on Linux only, the
# one OS Triton publishes wheels for: on macOS the lab runs its CPU path without it). On Linux, PyPI's
# torch is the CUDA build with its nvidia-* wheels, several GB: where pip would take it (asked with
# --dry-run: its report lists nvidia-* packages), the CPU build comes from PyTorch's own index first,
# and the pins then find torch installed. (Where torch resolves to a CPU wheel already, as on the
# lab's CI machines with their local wheels, nothing changes. Checked here: the dry run against
# PyPI alone lists nvidia-cublas and others; PyTorch's index was not reachable from these machines.)
TORCH_CPU_INDEX = https://download.pytorch.org/whl/cpu
# With a GPU: a CUDA torch wants the triton it was built with (torch 2.14.1 asks triton~=3.8), so the
# venv sees the image's packages and torch is left unpinned: pip keeps the installed one, or installs
# torch with the triton it requires. The editable install's metadata lives in the venv; the egg-info
# setuptools leaves beside the notebooks while building it would only sit in JupyterLab's file browser.
$(STAMP): requirements.txt requirements-cpu.txt pyproject.toml
	@set -e; \
	if [ ! -x $(PY) ] && ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then \
	  echo "venv: the lab needs Python 3.11 or newer as python3 (its pins, numpy and triton among them, need it); found: $$(python3 --version 2>&1)" >&2; \
	  exit 1; \
	fi; \
	if [ ! -x $(PY) ] && ! python3 -c 'import ensurepip, venv' 2>/dev/null; then \
	  echo "venv: python3 has no venv module (Debian and Ubuntu: apt install python3-venv)" >&2; \
	  exit 1; \
	fi; \
	if nvidia-smi >/dev/null 2>&1; then \
	  echo "venv: NVIDIA GPU found; keeping the installed torch/triton"; \
	  [ -x $(PY) ] || python3 -m venv --system-site-packages $(VENV); \
	  mkdir -p build; \
	  sed 's/^torch==.*/torch/' requirements.txt > build/requirements-gpu.txt; \
	  $(PY) -m pip install -q --progress-bar off -r build/requirements-gpu.txt; \
	else \
	  echo "venv: no NVIDIA GPU; installing the CPU pins"; \
	  [ -x $(PY) ] || python3 -m venv $(VENV); \
	  torch_pin=$$(grep '^torch==' requirements.txt); \
	  if [ "$$(uname -s)" = Linux ] && $(PY) -m pip install -q --dry-run --ignore-installed --report - "$$torch_pin" \
	       2>/dev/null | grep -q '"name": "nvidia-'; then \
	    echo "venv: PyPI's $$torch_pin for Linux is a CUDA build of several GB; taking the CPU build from $(TORCH_CPU_INDEX)"; \
	    $(PY) -m pip install -q --progress-bar off "$$torch_pin" --index-url $(TORCH_CPU_INDEX) \
	      || echo "venv: $(TORCH_CPU_INDEX) could not be reached; the CUDA build from PyPI follows"; \
	  fi; \
	  $(PY) -m pip install -q --progress-bar off -r requirements.txt -r requirements-cpu.txt; \
	fi; \
	$(PY) -m pip install -q --progress-bar off -e . --no-deps; \
	rm -rf prefill_decode_lab.egg-info; \
	touch $@

# The lab's JupyterLab defaults, in the venv's JupyterLab (a learner's own settings still win): no
# prompt over the lesson asking to fetch Jupyter's news, no check for newer JupyterLab releases
# (which would reach out to the network from a lab that needs none), closing a lesson's tab shuts
# its kernel down (each open lesson's kernel holds memory; README, "A room that outgrows one
# machine"), and a lesson only read closes without "Save your work?" (labkit/lab_contents.py).
# The same call `make lab` makes before it starts JupyterLab, and a hub's owner runs by hand.
$(VENV)/.defaults: $(DEFAULTS) labkit/launch.py $(STAMP)
	@$(PY) -m labkit.launch --install-defaults >/dev/null
	@touch $@

# numba compiles the CPU step's kernels on first use; here instead, at setup, and again whenever the
# code they are made from changes (a `git pull`), so no lesson waits for it.
$(WARM): $(STAMP) $(wildcard labkit/cpu_kernels/*.py) labkit/cpu_step.py labkit/cpu_decode.py labkit/cpu_linear.py labkit/warm.py
	@echo "venv: compiling the CPU decode step's numba kernels (up to ~40 s; see labkit/warm.py)"
	@$(PY) -m labkit.warm
	@touch $@

# No `playwright install`: its browser download is not reachable here; tests launch
# executable_path=/usr/bin/chromium and skip, with a reason, when it is missing.
browser: ## (internal) Install Debian's chromium for the browser tests if missing (an error only when CI=true)
	@if [ -x $(CHROMIUM) ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "browser: installing Debian chromium"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	fi; \
	if [ -x $(CHROMIUM) ]; then exit 0; fi; \
	if [ "$${CI:-}" = true ]; then echo "browser: could not install $(CHROMIUM) (CI=true)" >&2; exit 1; fi; \
	echo "browser: no $(CHROMIUM); browser tests will be skipped (as root: apt-get install chromium)"

# One implementation, labkit/launch.py, which a learner without make (Windows) runs as
# `python -m labkit.launch`: loopback only, always with a token (the caller's JUPYTER_TOKEN or a fresh
# one, passed in the environment), port_retries=0, the repository as root_dir, --no-browser without a
# display, --allow-root only as root. Its docstring says why each.
lab: venv ## Start JupyterLab on 127.0.0.1:PORT (default 8888) with a token, opening notebooks/01_two_phases.ipynb
	@exec $(PY) -m labkit.launch --port $(PORT)

# Standard library only, so any Python runs it before the venv is brought up to date.
update: ## git pull the lab; lessons you changed are kept in saved/<date-time>/ first; then set up what changed
	@$(if $(wildcard $(PY)),$(PY),python3) -m labkit.update
	@$(MAKE) --no-print-directory -s venv

# Plain nbstripout (here and in strip), as the repository's pre-commit check runs it: cell ids become
# their positions ("0", "1", ...), so stripping and verifying always agree.
# The notebooks' quick run: on a GPU machine here, on the GPU path with Triton; everywhere in
# test-no-triton, on the CPU path with Triton absent (a CPU runs no Triton kernel outside the tests).
# The CPU tests run first without Triton (test-no-triton), which records in build/triton-asked.txt
# every test that asked for it (tests/no_triton/sitecustomize.py). Without a GPU, the run with
# Triton then takes the tests marked `triton` and those that asked (tests/conftest.py): the others
# ran the same code without it, as the block's docstring argues (about 2 of `make test`'s minutes
# on 2 cores); pytest's header says which. With a GPU, every test runs again, on the GPU
# (LABKIT_WITH_TRITON_ONLY left empty).
test: venv browser ## Check notebooks are stripped, run tests/, run notebooks in quick mode (also without Triton), dry-run gpu-check
	@if [ -n "$(NOTEBOOKS)" ]; then \
	  echo "nbstripout --verify notebooks/*.ipynb"; \
	  $(VENV)/bin/nbstripout --verify $(NOTEBOOKS) || { echo "test: lessons hold outputs or metadata (JupyterLab saves them as you work): 'make keep' copies them to saved/<date-time>/ and sets them back to git's version; 'make strip' removes the outputs from the files" >&2; exit 1; }; \
	else echo "test: no notebooks yet; skipping nbstripout --verify"; fi
	rm -f build/triton-asked.txt
	$(MAKE) test-no-triton TEST_JOBS=$(TEST_JOBS)
	only=$$(nvidia-smi >/dev/null 2>&1 || echo build/triton-asked.txt); \
	LABKIT_WITH_TRITON_ONLY=$$only $(PY) -m pytest tests -n $(TEST_JOBS) -m "not timed" --ignore=tests/test_no_triton.py $(SERIAL_TESTS:%=--ignore=%)
	$(PY) -m pytest tests -m timed --ignore=tests/test_no_triton.py $(SERIAL_TESTS:%=--ignore=%)
	$(PY) -m pytest $(SERIAL_TESTS)
	LABKIT_CACHE_DIR=$(CURDIR)/build/test-cache $(MAKE) gpu-compile TARGETS=sm_90a
	@if [ -z "$(NOTEBOOKS)" ]; then echo "test: no notebooks yet; skipping pytest --nbval-lax"; \
	elif nvidia-smi >/dev/null 2>&1; then \
	  echo "LABKIT_QUICK=1 pytest --nbval-lax notebooks (the GPU path)"; \
	  LABKIT_QUICK=1 LABKIT_AUTO_REVEAL=1 LABKIT_CACHE_DIR=$(CURDIR)/build/test-cache/notebooks $(PY) -m pytest --nbval-lax notebooks; \
	fi

# The CPU path as on a Mac or a Windows laptop, where Triton has no wheels: NO_TRITON makes `import
# triton` fail as it fails there. Every notebook in quick mode on the CPU, then tests/test_no_triton.py:
# the CLI, the GPU check and compile check (which must say they are skipped, and why) and the CPU tests,
# each in a process without Triton. Any output that shows triton failing to import fails the target.
test-no-triton: venv ## The CPU path with Triton absent, as on macOS and Windows: notebooks (quick), CLI, CPU tests
	@set -e -o pipefail; mkdir -p build; \
	if [ -n "$(NOTEBOOKS)" ]; then \
	  echo "without Triton: LABKIT_QUICK=1 pytest --nbval-lax notebooks on the CPU"; \
	  $(NO_TRITON) LABKIT_DEVICE=cpu LABKIT_QUICK=1 LABKIT_AUTO_REVEAL=1 LABKIT_CACHE_DIR=$(CURDIR)/build/test-cache/notebooks \
	    $(PY) -m pytest --nbval-lax notebooks 2>&1 | tee build/no-triton-notebooks.log; \
	  if grep -n -E "No module named .triton|/triton/" build/no-triton-notebooks.log; then \
	    echo "test-no-triton: a notebook needed Triton (build/no-triton-notebooks.log)" >&2; exit 1; \
	  fi; \
	fi; \
	echo "without Triton: pytest tests/test_no_triton.py"; \
	TEST_JOBS=$(TEST_JOBS) $(PY) -m pytest tests/test_no_triton.py

# A GPU image may have torch/triton/numpy but no venv and no Jupyter: then the system python3
# runs it (`-m` from the repo root finds labkit without installing it).
# A dry run (DRY=1, as tests/test_gpu_check.py runs it, beside other tests) keeps its calibration in
# build/test-cache/gpu-check-dry, never in the user's labkit cache (~/.cache/labkit or LABKIT_CACHE_DIR).
gpu-check: ## Check this machine's GPU against the lab into OUT (default build/gpu-check; DRY=1: dry run, no GPU needed)
	@py=python3; if [ -x $(PY) ] && $(PY) -c '' 2>/dev/null; then py=$(PY); fi; \
	$(if $(filter 1,$(DRY)),export LABKIT_CACHE_DIR="$(CURDIR)/build/test-cache/gpu-check-dry";) \
	echo "$$py -m labkit.gpu_check --out $(OUT) $(if $(filter 1,$(DRY)),--dry-run)"; \
	$$py -m labkit.gpu_check --out $(OUT) $(if $(filter 1,$(DRY)),--dry-run)

# A benchmark, not a test: real timings of issue 13's tables (decode B = 1, 4, 16, 32 at S = 1,024; each
# cache dtype at B = 16, S = 4,096; prefill P = 1,024, 2,048, 4,096), each bracketed by bandwidth readings at
# its working set, after a fresh calibration. Run it on an idle machine; it never overwrites a recording.
bench: venv ## Measure issue 13's decode and prefill tables into data/recordings/bench-<device>.json (OUT=dir: there; a few minutes)
	$(PY) -m labkit bench --out $(if $(filter command line,$(origin OUT)),$(OUT),data/recordings)

# No GPU needed: triton's wheel ships ptxas. TRITON=3.6: against triton 3.6 (the GPU image's) in a
# side venv with the pinned CPU torch and numpy<2.4 (what triton 3.6's interpreter needs), made once.
gpu-compile: venv ## Compile every kernel for sm_75/80/89/90a without a GPU (TARGETS=sm_90a: some; TRITON=3.6: that triton)
	@set -e; py=$(PY); \
	if [ -n "$(TRITON)" ]; then \
	  case "$(TRITON)" in 3.[0-9]*) ;; *) echo "gpu-compile: error: TRITON=$(TRITON): the lab's kernels need triton 3 (checked with 3.6 and 3.9)" >&2; exit 2;; esac; \
	  py=$(TRITON_VENV)/bin/python; \
	  if ! $$py -c 'import torch, triton' >/dev/null 2>&1; then \
	    echo "gpu-compile: making $(TRITON_VENV) with triton $(TRITON)"; \
	    python3 -m venv $(TRITON_VENV); \
	    $$py -m pip install -q --progress-bar off "triton==$(TRITON).*" "numpy<2.4" "$$(grep '^torch==' requirements.txt)"; \
	  fi; \
	fi; \
	echo "$$py -m labkit.gpu_compile $(if $(TARGETS),--targets $(TARGETS))"; \
	$$py -m labkit.gpu_compile $(if $(TARGETS),--targets $(TARGETS))

# Kernels start in notebooks/ (--cwd), as they do under JupyterLab and nbval. PLOTLY_RENDERER: charts as
# plotly JSON alone, whatever the terminal; labkit.report.ReportExporter draws them (plotly.js inlined
# once per page) and leaves out the lab template's CDN scripts, so the HTML needs no network.
report: venv ## Execute every notebook with papermill (PARAMS="-p GPU H200") into build/report/, then to static HTML
	@set -e; \
	if [ -z "$(NOTEBOOKS)" ]; then echo "report: no notebooks in notebooks/"; exit 0; fi; \
	mkdir -p $(REPORT); \
	outs=; \
	for nb in $(NOTEBOOKS); do \
	  out=$(REPORT)/$$(basename $$nb); outs="$$outs $$out"; log=$${out%.ipynb}.papermill.log; \
	  echo "report: executing $$nb"; \
	  if ! LABKIT_AUTO_REVEAL=1 PLOTLY_RENDERER=plotly_mimetype $(VENV)/bin/papermill --cwd notebooks $$nb $$out $(PARAMS) 2>$$log; then \
	    echo "report: $$nb failed:" >&2; \
	    sed -n '/^Exception encountered/,$$p' $$log | grep . >&2 || tail -n 5 $$log >&2; \
	    echo "report: papermill's whole log is $$log, the notebook as far as it ran $$out" >&2; exit 1; \
	  fi; \
	done; \
	$(VENV)/bin/jupyter nbconvert --to labkit.report.ReportExporter --output-dir $(REPORT) $$outs

# --token makes Voilà ask for one; it takes the value from JUPYTER_TOKEN (kept out of `ps`).
# --template=labkit (share/jupyter/voila/templates/labkit, found through JUPYTER_PATH): Voilà's lab
# template without its CDN stylesheets and with the model method plotly's renderer calls; no
# ?template= or ?theme= from the URL can swap it out.
app: venv ## Serve NB (default notebooks/01_two_phases.ipynb) as a Voilà app on 127.0.0.1:PORT with a token
	@case "$(NB)" in *.ipynb) ;; *) echo "app: error: NB=$(NB) is not a notebook (.ipynb); the lessons: $(NOTEBOOKS)" >&2; exit 2;; esac; \
	if [ ! -f "$(NB)" ]; then echo "app: error: NB=$(NB): no such notebook; the lessons: $(NOTEBOOKS)" >&2; exit 2; fi; \
	case "$(PORT)" in ''|*[!0-9]*) echo "app: error: PORT=$(PORT) is not a port number" >&2; exit 2;; esac; \
	if $(PY) -c 'import sys; from labkit.launch import port_in_use; sys.exit(0 if port_in_use($(PORT)) else 1)'; then \
	  echo "app: error: port $(PORT) on 127.0.0.1 is in use (another server?); choose another, e.g. make app PORT=$$(($(PORT) + 1))" >&2; exit 2; fi; \
	$(TOKEN_SH); \
	echo "Voila: http://127.0.0.1:$(PORT)/?token=$$token"; \
	JUPYTER_TOKEN="$$token" JUPYTER_PATH="$(CURDIR)/share/jupyter$${JUPYTER_PATH:+:$$JUPYTER_PATH}" \
	  exec $(VENV)/bin/voila $(NB) --no-browser --Voila.ip=127.0.0.1 \
	  --port=$(PORT) --Voila.port_retries=0 --token --template=labkit \
	  --VoilaConfiguration.allow_template_override=NO --VoilaConfiguration.allow_theme_override=NO

# make test checks the lessons carry no outputs; a learner's, saved by JupyterLab, are kept first
keep: ## Copy the lessons you changed to saved/<date-time>/ and set them back to git's version (no pull)
	@$(if $(wildcard $(PY)),$(PY),python3) -m labkit.update --keep-only

strip: venv ## Remove outputs from notebooks/*.ipynb before committing (make test checks)
	@if [ -n "$(NOTEBOOKS)" ]; then $(VENV)/bin/nbstripout $(NOTEBOOKS); else echo "strip: no notebooks"; fi

clean: ## Remove build/ and .venv
	rm -rf build $(VENV) *.egg-info
