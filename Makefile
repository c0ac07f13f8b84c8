# The course's commands. Each works on a fresh clone with nothing but Python 3.11+ and make.
#   make lab     open the course in JupyterLab      make test    run the whole test suite
#   make check   the fast loop (tests/unit, < 90 s)  make bench   the benchmarks
#   make course  execute every notebook (papermill)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.gpucourse-installed
PYTEST_ARGS ?=

.PHONY: install lab kernel test check browser-pass course bench exercises clean

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "gpucourse needs Python 3.11 or newer; set PYTHON=python3.11")'
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "Installing the course and its packages into $(VENV) (once). The big one is torch: about 200 MB as a"
	@echo "CPU build, several GB where pip picks the CUDA build (Linux's default). It takes minutes; pip lists each package."
	@echo "After 'Installing collected packages' pip unpacks them without a word for a minute or two (torch is most of it)."
	$(BIN)/python -m pip install --progress-bar off --disable-pip-version-check -c constraints.txt -e ".[dev]"
	@echo "Installed into $(VENV)."
	@touch $(STAMP)

install: $(STAMP)

kernel: $(STAMP)
	$(BIN)/python -m ipykernel install --sys-prefix --name gpucourse --display-name "Python (gpucourse)" >/dev/null
	@echo "Jupyter kernel 'gpucourse' registered"

ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)

# JupyterLab's first-open question "get notified about Jupyter news?" covers the page: answered (no) for this
# .venv's JupyterLab only, through its application settings overrides, unless that file already exists.
LAB_OVERRIDES := $(VENV)/share/jupyter/lab/settings/overrides.json

$(LAB_OVERRIDES): $(STAMP)
	@mkdir -p $(dir $@)
	@test -e $@ || echo '{"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": false}}' > $@

# The status bar said "Idle" while a launch cell ran: JupyterLab took the status of a kernel-subshell request for the
# kernel's. The server setting that makes it ignore those (gpucourse/tools/labconfig.py says why), in this .venv's config.
SERVER_CONFIG := $(VENV)/etc/jupyter/jupyter_server_config.json

$(SERVER_CONFIG): $(STAMP) gpucourse/tools/labconfig.py
	@$(BIN)/python -m gpucourse.tools.labconfig $(VENV)

# JupyterLab opens your own copy of the chapters (mywork/, never overwritten by an update; see `gpucourse workspace`),
# so autosave never changes the course's notebooks and `git pull` never conflicts.
lab: kernel $(LAB_OVERRIDES) $(SERVER_CONFIG)
	@$(BIN)/gpucourse workspace
	$(BIN)/jupyter lab --notebook-dir=mywork $(ROOT_FLAG) $(LAB_ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q -rfEs $(PYTEST_ARGS)

# The fast loop, before every commit: the in-process tests (tests/unit/: the package's layers, the import rules, the
# notebooks read without running them). No job, notebook or browser is started; under 90 s on a 2-core machine.
check: $(STAMP)
	$(BIN)/python -m pytest -q -rfEs -p no:cacheprovider tests/unit $(PYTEST_ARGS)

# Every chapter run to the end in JupyterLab in headless Chromium, checked as drawn
# (tests/integration/test_browser_chapters.py); screenshots in $$GPUCOURSE_BROWSER_SHOTS or runs/browser-shots. Too long for `make test`: 35-50 min on a loaded 2-core machine.
browser-pass: $(STAMP)
	$(BIN)/python -m pytest -m browser_pass -q -rA -p no:cacheprovider \
		tests/integration/test_browser_chapters.py $(PYTEST_ARGS)

course: kernel
	$(BIN)/gpucourse course $(COURSE_ARGS)

bench: $(STAMP)
	@for b in benchmarks/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

exercises: $(STAMP)
	$(BIN)/gpucourse make-exercises

clean:  # mywork/ (your chapters) is never cleaned
	rm -rf runs executed .pytest_cache
