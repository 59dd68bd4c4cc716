# llava-sessions: LLaVA with stateful sessions on TorchServe, as a SageMaker BYOC image.
#
# Built on AWS's Ray Serve SageMaker container, the supported successor of the TorchServe-based
# PyTorch inference DLC (AWS stopped patching that one on 2026-06-30): the image keeps AWS's
# patched OS and Python, installs vLLM's GPU wheel (its own torch; ENGINE=transformers keeps
# AWS's CUDA-matched torch instead: see "The kit" below), and adds what the old DLC brought
# itself - Java 17 (Amazon Corretto), TorchServe 0.12.0 and a `serve` entrypoint that starts
# TorchServe as the DLC's toolkit did (docker/torchserve/serve). TorchServe 0.12.0 with its Java frontend and the
# kit were measured on this base's Python 3.13 and the old DLC's torch 2.6.0 (docs/ray.md, "The
# TorchServe image's base"). The Ray Serve front (docker/ray/Dockerfile) builds FROM the same tag.
# Build it with ./build_and_push.sh, which logs in to the DLC registry first (the base image is
# private to AWS accounts).
#
# The DLC registry account 763104351884 serves most commercial regions; opt-in regions and China
# use other accounts: pass BASE_IMAGE there.
ARG REGION=us-east-1
ARG BASE_IMAGE=763104351884.dkr.ecr.${REGION}.amazonaws.com/ray:serve-ml-sagemaker-cuda-v1.1.0

# --- /ping that waits for the model (a stage of its own: its JDK stays out of the image) ---------
# TorchServe 0.12's /ping answers 200 while the model is still loading; docker/torchserve/
# ready-ping/ReadyPing.java, a TorchServe endpoint plugin, answers 200 only once the model can
# answer. Compiled against the model-server.jar of the TorchServe the image installs (the `serve`
# extra pins 0.12.0).
FROM ${BASE_IMAGE} AS ready-ping
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY docker/check_base.sh /tmp/
RUN /tmp/check_base.sh
# The JDK from the base's own package manager, unpinned as the Java below (the distribution's
# patches are the point); it never reaches the image.
# hadolint ignore=DL3008,DL3041
RUN if command -v dnf >/dev/null; then dnf install -y java-17-amazon-corretto-devel && dnf clean all; \
    else apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends openjdk-17-jdk-headless \
        && rm -rf /var/lib/apt/lists/*; \
    fi
COPY docker/torchserve/ready-ping/ReadyPing.java /src/
RUN python -m pip download --no-deps --no-cache-dir -d /tmp/ts torchserve==0.12.0 \
 && python -m zipfile -e /tmp/ts/torchserve-0.12.0-*.whl /tmp/ts/wheel \
 && javac --release 17 -cp /tmp/ts/wheel/ts/frontend/model-server.jar -d /out/classes /src/ReadyPing.java \
 && mkdir -p /out/classes/META-INF/services \
 && echo llava.sessions.ReadyPing > /out/classes/META-INF/services/org.pytorch.serve.servingsdk.ModelServerEndpoint \
 && python -c "import shutil; shutil.make_archive('/out/llava-ready-ping', 'zip', '/out/classes')" \
 && mv /out/llava-ready-ping.zip /out/llava-ready-ping.jar

FROM ${BASE_IMAGE}

# Fail a RUN when any command of a pipeline fails, not only the last one.
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY docker/check_base.sh /opt/llava-sessions/
RUN /opt/llava-sessions/check_base.sh

# --- Java for TorchServe's frontend -------------------------------------------------------------
# TorchServe 0.12.0's frontend is Java (17, the release it is built and tested with). The Ray
# container is Amazon Linux 2023, whose own Corretto build gets the distribution's security
# updates (dnf); BASE_IMAGE=<the PyTorch inference DLC> is Ubuntu and already has a Java 17 for
# its TorchServe (else apt's OpenJDK 17 goes in, unpinned: the distribution's patches are the
# point, as with dnf).
# hadolint ignore=DL3008
RUN if java -version 2>&1 | grep 'version "17' >/dev/null; then echo "Java 17: the base's"; \
    elif command -v dnf >/dev/null; then \
        dnf install -y java-17-amazon-corretto-headless && dnf clean all && rm -rf /var/cache/dnf; \
    else \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends openjdk-17-jre-headless \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
 && java -version

# --- Optional: bake the model into the image --------------------------------------------------
# By default the image holds no weights: SageMaker downloads the model data named by the model's
# ModelDataUrl / ModelDataSource (uncompressed, S3DataType=S3Prefix, CompressionType=None) into
# /opt/ml/model, which must hold an unpacked TorchServe archive
# (`torch-model-archiver --archive-format no-archive`, i.e. with MAR-INF/MANIFEST.json).
#
# MODEL_DIR=<path inside the build context> copies such an unpacked archive to /opt/ml/model
# instead. Deploy a baked image WITHOUT ModelDataUrl/ModelDataSource: model data, when given, is
# placed at /opt/ml/model, where it hides or mixes with the baked copy - the image would carry
# gigabytes for nothing, or serve a blend of two archives. Baking trades a larger image (slower
# first pull, a new image per weight change) for no S3 download at start-up. (Not verified on a
# live endpoint: that SageMaker leaves the image's /opt/ml/model alone when a model has no model
# data. A baked image's first deployment should be watched until /ping answers 200.)
#
# The COPY sits before the kit install so that changing the kit's code does not re-copy or re-push
# a multi-gigabyte weights layer. COPY cannot be skipped conditionally, so with MODEL_DIR empty it
# copies a one-file placeholder, deleted again by the RUN below.
ARG MODEL_DIR=
COPY ${MODEL_DIR:-docker/no-model}/ /opt/ml/model/
RUN if [ -n "${MODEL_DIR}" ] && [ ! -f /opt/ml/model/MAR-INF/MANIFEST.json ]; then \
        echo "MODEL_DIR=${MODEL_DIR} has no MAR-INF/MANIFEST.json: create it with" \
             "'torch-model-archiver --archive-format no-archive ...' or build without MODEL_DIR" >&2; \
        exit 1; \
    fi \
 && rm -f /opt/ml/model/.llava-no-model

# --- The kit ----------------------------------------------------------------------------------
# ENGINE=vllm (the default): the kit on vLLM's engine, vLLM's GPU wheel of the release the CPU
# tests run (docker/image.lock pins it with everything else). That wheel requires its own torch
# (2.13.0, CUDA 13: deploy on SageMaker's al2023-ami-sagemaker-inference-gpu-4-1, driver 580,
# which `make deploy` selects) and replaces the base's. ENGINE=transformers keeps the base's torch
# and serves with the transformers engine (the reference). VLLM_BUILD=cpu installs vLLM's CPU
# build of the same release instead of the GPU wheel: the variant the tests build and run on
# machines without a GPU (docker/standin/build.sh, make test-images). docker/install_kit.sh does
# the install for both images: the base's pins, the kit (TorchServe 0.12.0 and
# torch-model-archiver come with its `serve` extra) under them and the lock, then the pins of
# what is installed, which PIP_CONSTRAINT below makes every later pip run honour (`serve`'s
# start-up install of /opt/ml/model/code/requirements.txt, images built FROM this one).
ARG ENGINE=vllm
ARG VLLM_BUILD=gpu
COPY docker/base_constraints.py docker/image.lock docker/install_kit.sh /opt/llava-sessions/
COPY docker/vllm-cpu/mend.sh docker/vllm-cpu/llava_kit_no_torchvision.py /opt/llava-sessions/vllm-cpu/
# README.md is pyproject's readme (the wheel's long description); the trailing * lets the build go
# on without it, as setuptools only warns when it is missing.
COPY pyproject.toml README.md* /tmp/llava-sessions-src/
# The dependencies first, from pyproject.toml alone (over an empty package), so that a change to
# the kit's code rebuilds only the small layer after them.
RUN mkdir /tmp/llava-sessions-src/llava && touch /tmp/llava-sessions-src/llava/__init__.py \
 && /opt/llava-sessions/install_kit.sh deps torchserve "${ENGINE}" "${VLLM_BUILD}" /tmp/llava-sessions-src
COPY llava/ /tmp/llava-sessions-src/llava/
RUN /opt/llava-sessions/install_kit.sh code /tmp/llava-sessions-src && rm -rf /tmp/llava-sessions-src

# --- TorchServe and kit settings ----------------------------------------------------------------
# docker/torchserve/sagemaker-ts.properties sets enable_envvars_config=true, so TorchServe reads
# TS_<KEY> variables, and they take precedence over that file. Any of these can be
# changed per deployment through the SageMaker model's Environment without rebuilding.
#   TS_DEFAULT_RESPONSE_TIMEOUT: seconds TorchServe waits for each handler message before it kills
#     and restarts the worker - which loses the answers being generated (sessions come back from
#     their snapshots, at their last finished turn) - so it is
#     set well above the slowest legitimate generation. (A per-model responseTimeout in
#     model-config.yaml wins over it.) SageMaker's own 60 s limit on non-streaming responses is
#     enforced at the router.
#   TS_DEFAULT_STARTUP_TIMEOUT: seconds a worker may spend loading the model (default 120) - too
#     short for reading LLaVA's weights from disk onto the GPU.
#   TS_MAX_REQUEST_SIZE: 16 MiB, above SageMaker's 6 MiB body limit, which the kit enforces itself
#     (a local run rejects what SageMaker would, with a JSON 413 that names the limit; TorchServe's
#     own 413, past 16 MiB, has no body). TS_MAX_RESPONSE_SIZE: SageMaker's 6 MiB.
#   LLAVA_DRAIN_GRACE_S / LLAVA_DRAIN_TIMEOUT_S: on SIGTERM, answers in flight get 20 s to finish
#     and the whole drain, the store's flush included, 27 s: inside the 30 s between SIGTERM and
#     SIGKILL that `docker stop` gives by default (SageMaker's own grace is not documented).
#   LLAVA_SESSION_TTL_S: idle seconds before a session expires (1200 s, as AWS containers use);
#     every handler setting of model-config.yaml has such an LLAVA_<NAME> override.
# The kit's session gauges (sessions and bytes per memory tier) next to TorchServe's own metrics.
COPY handler/metrics.yaml /opt/llava-sessions/metrics.yaml
# The ready /ping (the stage above), which `serve` passes to TorchServe as its plugins.
COPY --from=ready-ping /out/llava-ready-ping.jar /opt/llava-sessions/plugins/
COPY docker/torchserve/sagemaker-ts.properties /opt/llava-sessions/sagemaker-ts.properties
ENV TS_DEFAULT_RESPONSE_TIMEOUT=300 \
    TS_METRICS_CONFIG=/opt/llava-sessions/metrics.yaml \
    TS_DEFAULT_STARTUP_TIMEOUT=600 \
    TS_MAX_REQUEST_SIZE=16777216 \
    TS_MAX_RESPONSE_SIZE=6291456 \
    LLAVA_SESSION_TTL_S=1200 \
    LLAVA_DRAIN_GRACE_S=20 \
    LLAVA_DRAIN_TIMEOUT_S=27 \
    PIP_CONSTRAINT=/opt/llava-sessions/constraints.txt \
    LOG_LOCATION=/var/log/torchserve \
    METRICS_LOCATION=/var/log/torchserve

# --- Serving ----------------------------------------------------------------------------------
# SageMaker runs `docker run IMAGE serve` with the unpacked archive at /opt/ml/model: `serve`
# starts TorchServe in the foreground on 8080 with it as the model `model`, as the old DLC's
# toolkit did, so deployments, the local runtime and the AWS sample's calls are unchanged.
COPY docker/torchserve/serve /usr/local/bin/serve
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/serve"]

# Last, so that a new commit only changes image metadata, not a cached layer.
ARG BASE_IMAGE
ARG VCS_REF=unknown
LABEL org.opencontainers.image.title="llava-sessions" \
      org.opencontainers.image.description="LLaVA with stateful sessions on TorchServe, for SageMaker sticky-session endpoints" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.revision="${VCS_REF}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"
