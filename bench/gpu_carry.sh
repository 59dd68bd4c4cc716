#!/usr/bin/env bash
# What a GPU machine with torch but no Java, TorchServe or internet needs for bench/gpu_check.sh,
# packed small enough for a remote-run tool that carries 64 MiB with the working tree (about
# 37 MB): TorchServe 0.12.0 and its archiver as wheels, TorchServe's frontend jar stored
# uncompressed then xz'd (42 -> 20 MB), and a Java 17 runtime cut by jlink to the modules the
# frontend loads (java.desktop for java.beans included), xz'd (17 MB). Needs this machine's JDK
# 17 (jlink) and pip. Writes .whl/ (ignored by git); unpack there as gpu_check.sh's header says.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.whl
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude

python3 -m pip download -q --no-deps --only-binary=:all: -d "$work" \
    torchserve==0.12.0 torch-model-archiver==0.12.0
cp "$work"/torch_model_archiver-0.12.0-py3-none-any.whl "$out/"
mkdir "$work/ts" "$work/jar"
(cd "$work/ts" && python3 -m zipfile -e "$work"/torchserve-0.12.0-py3-none-any.whl .)
(cd "$work/jar" && python3 -m zipfile -e "$work/ts/ts/frontend/model-server.jar" .)
rm "$work/ts/ts/frontend/model-server.jar"
sed -i '/model-server.jar/d' "$work"/ts/torchserve-0.12.0.dist-info/RECORD
(cd "$work/ts" && python3 -m zipfile -c "$OLDPWD/$out/torchserve-0.12.0-py3-none-any.whl" \
    ts torchserve-0.12.0.dist-info)
python3 - "$work/jar" "$work/model-server.jar" <<'EOF'
import os, sys, zipfile
src, jar = sys.argv[1:]
with zipfile.ZipFile(jar, "w", zipfile.ZIP_STORED) as z:  # stored: xz then packs it small
    z.write(os.path.join(src, "META-INF/MANIFEST.MF"), "META-INF/MANIFEST.MF")
    for root, dirs, files in os.walk(src):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            if os.path.relpath(path, src) != "META-INF/MANIFEST.MF":
                z.write(path, os.path.relpath(path, src))
EOF
xz -T0 -c "$work/model-server.jar" > "$out/model-server.jar.xz"

jlink --add-modules java.base,java.logging,java.management,java.naming,java.xml,java.sql,\
jdk.unsupported,jdk.crypto.ec,jdk.management,java.desktop \
    --strip-debug --no-header-files --no-man-pages --compress=0 --output "$work/jre-min"
rm -f "$work"/jre-min/lib/lib{awt_xawt,splashscreen,fontmanager,freetype,javajpeg,lcms,mlib_image}.so
tar -C "$work" -cJf "$out/jre-min.tar.xz" jre-min
du -sh "$out"/*
