#!/usr/bin/env bash
# Build the llava-sessions SageMaker image and push it to Amazon ECR. Run with -h for usage.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: ./build_and_push.sh [repository] [tag]

Builds the image from this directory (linux/amd64, on AWS's Ray Serve SageMaker container) and
pushes it to Amazon ECR in your account.

  repository  ECR repository name, created (scan on push) when missing. Default: llava-sessions
  tag         image tag. Default: the short commit of HEAD when this directory is a git work tree
              with a commit, otherwise "latest".

Environment:
  AWS_REGION      region to push to (and to pull the base image from); if unset AWS_DEFAULT_REGION,
                  then `aws configure get region`.
  BASE_IMAGE      optional: another base image, passed as a build arg (e.g. the DLC account of an
                  opt-in or China region, or AWS's Container-Caching-eligible PyTorch inference
                  DLC for FRONT=torchserve; see docs/sagemaker.md, "The images' base").
  ENGINE          vllm (default: vLLM's GPU wheel from docker/image.lock, which brings its own
                  torch; deploy on the al2023-ami-sagemaker-inference-gpu-4-1 AMI, as
                  `make deploy` does) or transformers (the base image's torch, the reference engine).
  FRONT           torchserve (default: the Dockerfile, TorchServe 0.12 and Java 17 added to AWS's
                  Ray Serve SageMaker container) or ray (docker/ray/Dockerfile, Ray Serve; default
                  repository llava-sessions-ray; its model data is `python -m llava package-ray`).
  MODEL_DIR       optional, FRONT=torchserve only: an unpacked TorchServe archive (with MAR-INF/MANIFEST.json, made by
                  `torch-model-archiver --archive-format no-archive`) inside this directory, baked
                  into /opt/ml/model. Deploy such an image WITHOUT ModelDataUrl.

Needs the AWS CLI v2 and Docker with the buildx plugin, and credentials allowed to call
sts:GetCallerIdentity and the ECR describe/create-repository, login and push actions.
Progress goes to stderr; the last line on stdout is the pushed image URI:

  image_uri=$(./build_and_push.sh)
EOF
}

# The AWS account that publishes the Deep Learning Containers in most commercial regions.
readonly DLC_ACCOUNT=763104351884

log() { printf '==> %s\n' "$*" >&2; }
die() {
  printf 'error: %s\n' "$*" >&2
  exit 1
}

# --- Arguments ---------------------------------------------------------------------------------
case "${1:-}" in
  -h | --help)
    usage
    exit 0
    ;;
  -*)
    usage >&2
    die "unknown option '$1'"
    ;;
  *) ;;
esac
if (($# > 2)); then
  usage >&2
  die "expected at most 2 arguments (repository, tag), got $#"
fi

# The build context is the directory holding this script (and the Dockerfile), wherever it is run
# from; the default tag and MODEL_DIR are resolved there too.
context_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$context_dir"

front="${FRONT:-torchserve}"
case "$front" in
  torchserve) dockerfile=Dockerfile default_repository=llava-sessions ;;
  ray) dockerfile=docker/ray/Dockerfile default_repository=llava-sessions-ray ;;
  *) die "unknown FRONT=$front: use torchserve or ray" ;;
esac
if [[ "$front" == ray && -n "${MODEL_DIR:-}" ]]; then
  die "MODEL_DIR is for FRONT=torchserve: the Ray image takes its weights as model data (python -m llava package-ray)"
fi
engine="${ENGINE:-vllm}"
case "$engine" in
  vllm | transformers) ;;
  *) die "unknown ENGINE=$engine: use vllm (vLLM's GPU wheel) or transformers (the base image's torch)" ;;
esac

repository="${1:-$default_repository}"
repository_re='^[a-z0-9]+([._-][a-z0-9]+)*(/[a-z0-9]+([._-][a-z0-9]+)*)*$'
if ! [[ "$repository" =~ $repository_re ]] || ((${#repository} < 2 || ${#repository} > 256)); then
  die "invalid ECR repository name '$repository': use 2-256 lowercase letters, digits and . _ - / (e.g. llava-sessions)"
fi

if (($# == 2)); then
  tag="$2"
elif commit="$(git rev-parse --short HEAD 2>/dev/null)"; then
  tag="$commit"
else
  tag=latest
fi
tag_re='^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$'
if ! [[ "$tag" =~ $tag_re ]]; then
  die "invalid image tag '$tag': use up to 128 letters, digits and . _ - (not starting with . or -)"
fi
# Recorded as the org.opencontainers.image.revision label, so an image with a custom tag can still
# be traced to its source.
revision="$(git rev-parse HEAD 2>/dev/null)" || revision=unknown

command -v aws >/dev/null 2>&1 ||
  die "the AWS CLI is not on PATH: install AWS CLI v2 (https://docs.aws.amazon.com/cli/latest/userguide/getting-started-install.html)"
command -v docker >/dev/null 2>&1 ||
  die "docker is not on PATH: install Docker (with the buildx plugin) and start it"

# --- Region ------------------------------------------------------------------------------------
region="${AWS_REGION:-${AWS_DEFAULT_REGION:-}}"
if [[ -z "$region" ]]; then
  region="$(aws configure get region 2>/dev/null || true)"
fi
if [[ -z "$region" ]]; then
  die "no AWS region: set AWS_REGION (e.g. export AWS_REGION=us-east-1) or run 'aws configure set region us-east-1', then retry"
fi
region_re='^[a-z]{2}(-[a-z]+)+-[0-9]+$'
if ! [[ "$region" =~ $region_re ]]; then
  die "invalid AWS region '$region' (expected e.g. us-east-1): fix AWS_REGION / AWS_DEFAULT_REGION or your AWS config"
fi
case "$region" in
  cn-*) domain=amazonaws.com.cn ;;
  *) domain=amazonaws.com ;;
esac

# --- Optional baked model: check it here rather than after pulling a multi-GB base image -------
if [[ -n "${MODEL_DIR:-}" ]]; then
  MODEL_DIR="${MODEL_DIR#"$context_dir"/}"
  case "$MODEL_DIR" in
    /* | .. | ../* | */.. | */../*)
      die "MODEL_DIR=$MODEL_DIR is outside the build context: move the unpacked archive under $context_dir (e.g. model-store/llava) and give MODEL_DIR relative to it"
      ;;
  esac
  if [[ ! -f "$MODEL_DIR/MAR-INF/MANIFEST.json" ]]; then
    die "MODEL_DIR=$MODEL_DIR has no MAR-INF/MANIFEST.json: create an unpacked archive with 'torch-model-archiver --archive-format no-archive --export-path model-store ...' and point MODEL_DIR at it, or unset MODEL_DIR to load weights from the SageMaker model data"
  fi
fi

# buildx (BuildKit) is required, not the legacy builder: --provenance=false and --output type=docker
# keep the pushed image a single Docker v2 manifest. With provenance attestations, or OCI media
# types (Docker Desktop's containerd image store), SageMaker's CreateModel rejects the image with
# "Unsupported manifest media type". BuildKit also sends only the paths the Dockerfile copies.
docker buildx version >/dev/null 2>&1 ||
  die "docker buildx is not available: install the Docker buildx plugin (e.g. docker-buildx-plugin) and make sure the Docker daemon is running"

# --- Account and repository --------------------------------------------------------------------
log "Region $region; looking up the AWS account"
if ! account="$(aws sts get-caller-identity --query Account --output text --region "$region")"; then
  die "could not identify the AWS account: configure credentials (aws configure, AWS_PROFILE, or aws sso login) and retry"
fi
if ! [[ "$account" =~ ^[0-9]{12}$ ]]; then
  die "unexpected account id '$account' from 'aws sts get-caller-identity': check your AWS CLI configuration"
fi
registry="$account.dkr.ecr.$region.$domain"
image_uri="$registry/$repository:$tag"

if describe_errors="$(aws ecr describe-repositories --region "$region" --repository-names "$repository" 2>&1 >/dev/null)"; then
  log "ECR repository $repository exists"
elif [[ "$describe_errors" == *RepositoryNotFoundException* ]]; then
  log "Creating ECR repository $repository"
  aws ecr create-repository --region "$region" --repository-name "$repository" \
    --image-scanning-configuration scanOnPush=true >/dev/null ||
    die "could not create ECR repository $repository: allow ecr:CreateRepository, or have it created with 'aws ecr create-repository --repository-name $repository --region $region'"
else
  printf '%s\n' "$describe_errors" >&2
  die "could not look up ECR repository $repository in $region (see above): check that your credentials allow ecr:DescribeRepositories"
fi

# --- Registry logins ---------------------------------------------------------------------------
ecr_login() { # <registry host> <region>
  log "Logging in to $1"
  aws ecr get-login-password --region "$2" | docker login --username AWS --password-stdin "$1" >&2 ||
    die "docker login to $1 failed: check your credentials (ecr:GetAuthorizationToken) and that the Docker daemon is running"
}

# The base image lives in AWS's DLC registry, which needs its own login; a BASE_IMAGE from another
# ECR registry gets one too, and any other registry is left to docker's existing credentials.
base_registry="$DLC_ACCOUNT.dkr.ecr.$region.$domain"
base_region="$region"
if [[ -n "${BASE_IMAGE:-}" ]]; then
  base_host="${BASE_IMAGE%%/*}"
  ecr_host_re='^[0-9]{12}\.dkr\.ecr\.([a-z0-9-]+)\.amazonaws\.com(\.cn)?$'
  if [[ "$base_host" =~ $ecr_host_re ]]; then
    base_registry="$base_host"
    base_region="${BASH_REMATCH[1]}"
  else
    base_registry=""
    log "BASE_IMAGE is not in ECR: using docker's existing credentials to pull it"
  fi
fi
if [[ -n "$base_registry" && "$base_registry" != "$registry" ]]; then
  ecr_login "$base_registry" "$base_region"
fi
ecr_login "$registry" "$region"

# --- Build, tag, push --------------------------------------------------------------------------
build_args=(--build-arg "REGION=$region" --build-arg "ENGINE=$engine")
if [[ -n "${BASE_IMAGE:-}" ]]; then
  build_args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
fi
if [[ -n "${MODEL_DIR:-}" ]]; then
  build_args+=(--build-arg "MODEL_DIR=$MODEL_DIR")
fi
build_args+=(--build-arg "VCS_REF=$revision")

log "Building $repository:$tag from $dockerfile (linux/amd64)"
docker buildx build --platform linux/amd64 --provenance=false --output type=docker \
  -f "$dockerfile" "${build_args[@]}" -t "$repository:$tag" . >&2 ||
  die "docker build failed (see above)"

docker tag "$repository:$tag" "$image_uri"
log "Pushing $image_uri"
docker push "$image_uri" >&2 ||
  die "docker push failed (see above): check that your credentials allow ecr:InitiateLayerUpload/PutImage on $repository"

log "Done. Use this image URI for the SageMaker model:"
printf '%s\n' "$image_uri"
