# Two commands matter: `make serve` and `make test`. Everything else is a step they use.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
MODEL  ?= tiny
NAME   ?= llava
STORE  ?= model-store
TORCH_VERSION ?= 2.13.0
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: help venv dev archive serve stop test lint clean

help:
	@echo "make serve   build the model archive and serve it on 127.0.0.1:8080 (MODEL=$(MODEL))"
	@echo "make test    run the whole test suite"

# torch first, from the pinned CPU wheel: letting pip resolve it pulls a multi-GB CUDA build.
$(BIN)/.installed: pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (or set PYTHON=)"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q -e ".[engine,serve,aws,dev]"
	@touch $@

venv: $(BIN)/.installed

archive: venv
	$(BIN)/python -m llava archive --model $(MODEL) --name $(NAME) --out $(STORE)

serve: archive
	@$(BIN)/python -m llava.quickstart --name $(NAME)
	$(BIN)/torchserve --start --foreground --ncs --disable-token-auth \
		--ts-config config.properties --model-store $(STORE) --models $(NAME)=$(NAME)

stop:
	$(BIN)/torchserve --stop

lint: venv
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

test: venv lint
	$(BIN)/python -m pytest -q -p no:cacheprovider

clean:
	rm -rf build logs $(STORE)/* key_file.json
