#!/usr/bin/env bash
# Say at once what a BASE_IMAGE lacks that the kit's Dockerfiles rely on (python with pip on
# PATH, a package manager for Java and libraries), rather than fail later on a raw shell error.
set -uo pipefail
missing=()
command -v python >/dev/null 2>&1 || missing+=("python on PATH")
python -m pip --version >/dev/null 2>&1 || missing+=("pip for that python")
command -v dnf >/dev/null 2>&1 || command -v apt-get >/dev/null 2>&1 \
    || missing+=("a package manager (dnf or apt-get)")
if ((${#missing[@]})); then
    joined=$(printf '%s, ' "${missing[@]}")
    echo "BASE_IMAGE lacks ${joined%, }: build FROM AWS's Ray Serve SageMaker container (the" \
        "default), its PyTorch inference container, or the stand-in docker/standin/build.sh makes" >&2
    exit 1
fi
