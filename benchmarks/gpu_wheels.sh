#!/usr/bin/env bash
# What the GPU machine that the device tool lends lacks, gathered into .whl/ (kept out of git through
# .git/info/exclude) to travel with the working tree: the device tool's `carry: [".whl"]` (docs/speed.md, "The GPU
# check", has the call). That machine has Python 3.12, torch 2.11.0+cu130, numpy 2.5.2, imageio, matplotlib,
# tensorboard and pytest, and no package registry; the tree that travels is at most 64 MiB, so this fails if the
# bundle passes 60 MiB or the bundle and the tree together pass 64 MiB.
# - .whl/*.whl: the Python packages our scripts import that it lacks, at the versions CI installs, and
#   typing_extensions (tyro needs >= 4.13; that machine's version is unknown). numpy is not carried: procgen-mirror's
#   and gym3's numpy<2 pin is metadata only (pip installs with --no-deps there), and the games step with numpy 2
#   (the preflight checks it there).
# - .whl/lib/: the system libraries procgen's bundled Qt loads that its wheel does not ship (libGL, libglib-2.0 and
#   the X11 chain; `ldd procgen/data/prebuilt/libenv.so` lists them), from Debian 12 packages (apt-get download; their
#   newest symbols need glibc 2.34), unpacked here, never into /. gpu_bench.sh puts on LD_LIBRARY_PATH only those the
#   machine lacks. A check below runs ldd with them: everything but glibc, libstdc++ and libgcc_s must resolve to
#   the wheel's own libraries or to .whl/lib/.
# Run as root (apt-get), from anywhere: bash benchmarks/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
rm -rf .whl  # one version of each package (two would stop the whole install there), no old SHA256SUMS
mkdir -p .whl/lib
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

platforms="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms -d .whl \
    procgen-mirror==0.10.7 gym3==0.3.3 gymnasium==1.4.0 farama-notifications==0.0.6 gym-notices==0.1.0 \
    tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 typing-extensions==4.16.0 cffi==1.17.1 pycparser==3.12
python3 -m pip wheel -q --no-deps -w .whl gym==0.26.2  # pure Python, published as a source archive only

# library:Debian package, for every library of procgen's that is neither in its wheel nor glibc, libstdc++, libgcc_s
libraries="libGL.so.1:libgl1 libGLX.so.0:libglx0 libGLdispatch.so.0:libglvnd0 libglib-2.0.so.0:libglib2.0-0
    libgthread-2.0.so.0:libglib2.0-0 libpcre2-8.so.0:libpcre2-8-0 libX11.so.6:libx11-6 libxcb.so.1:libxcb1
    libXau.so.6:libxau6 libXdmcp.so.6:libxdmcp6 libbsd.so.0:libbsd0 libmd.so.0:libmd0 libz.so.1:zlib1g"
packages=$(for pair in $libraries; do echo "${pair#*:}"; done | sort -u)
apt="-oDir::State::Lists=$scratch/lists -oDir::Cache=$scratch/cache -oAPT::Architecture=amd64
    -oAPT::Architectures=amd64 -oAPT::Sandbox::User=root"  # its own package lists: the machine's stay untouched
mkdir -p "$scratch/lists/partial" "$scratch/cache/archives/partial" "$scratch/debs" "$scratch/root"
apt-get $apt -qq update
(cd "$scratch/debs" && apt-get $apt -qq download $packages)
for deb in "$scratch"/debs/*.deb; do
    dpkg-deb -x "$deb" "$scratch/root"
done
for pair in $libraries; do  # each library as one plain file under its soname (no links to travel)
    cp -L "$(find "$scratch/root" -name "${pair%%:*}" | head -1)" .whl/lib/
done

# The check: procgen's games library, with the carried libraries first, needs nothing else but the base libraries.
unzip -q .whl/procgen_mirror-*.whl 'procgen/data/prebuilt/*' 'procgen_mirror.libs/*' -d "$scratch/procgen"
base='^(/[^ ]*/)?(linux-vdso|ld-linux-x86-64|libc|libm|libdl|librt|libpthread|libresolv|libstdc\+\+|libgcc_s)\.so'
unexpected=$(LD_LIBRARY_PATH=.whl/lib ldd "$scratch"/procgen/procgen/data/prebuilt/libenv.so \
    | awk '{print $1, $3}' | grep -Ev "$base" | grep -v -e "procgen_mirror.libs/" -e "\.whl/lib/" || true)
if [ -n "$unexpected" ]; then
    echo "error: procgen's libenv.so needs libraries neither its wheel nor .whl/lib holds: $unexpected" >&2
    exit 1
fi

bundle=$(du -sb .whl | cut -f1)
tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
mib() { echo "$(( ($1 + 1048575) / 1048576 ))"; }
echo "gpu_wheels.sh: .whl/ holds $(ls .whl/*.whl | wc -l) wheels and $(ls .whl/lib | wc -l) libraries:" \
    "$(mib "$bundle") MiB ($bundle bytes); with the working tree that travels: $(mib $((bundle + tree))) MiB"
if [ "$bundle" -gt $((60 * 1048576)) ] || [ $((bundle + tree)) -gt $((64 * 1048576)) ]; then
    echo "error: over the limits: the bundle at most 60 MiB, the bundle and the tree together at most 64 MiB" >&2
    exit 1
fi
# Written last, so that its presence means the bundle is whole: CHECK_WHEELS=1 gpu_bench.sh (and gpu_bench.sh itself,
# before any step) verifies every file against it. A temporary file beside it, synced, then renamed over it.
(cd .whl && find . -type f ! -name 'SHA256SUMS*' -printf '%P\n' | sort | xargs -d '\n' sha256sum > SHA256SUMS.tmp \
    && sync SHA256SUMS.tmp && mv SHA256SUMS.tmp SHA256SUMS)
echo "gpu_wheels.sh: .whl/SHA256SUMS lists $(wc -l < .whl/SHA256SUMS) files; check with: CHECK_WHEELS=1 bash benchmarks/gpu_bench.sh"
