#!/usr/bin/env bash
# Wheels for the GPU machine the device tool lends (Python 3.12, PyTorch, numpy 2, imageio, matplotlib, tensorboard
# and pytest already there; no package registry): the packages our scripts need that it lacks, downloaded here into
# .whl/ (about 50 MB; the working tree that travels is limited to 64 MiB, so numpy is not carried: procgen-mirror's
# numpy<2 pin is metadata only, and its games step with numpy 2, checked here with numpy 2.2.6 on Python 3.12).
# Then, through the device tool, with carry [".whl"] and a command such as
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site && PYTHON=python3 bash benchmarks/gpu_bench.sh
# with $OUT set by the device tool. `echo /.whl/ >> .git/info/exclude` keeps the wheels out of git.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms -d .whl \
    procgen-mirror==0.10.7 gym3==0.3.3 gymnasium==1.4.0 farama-notifications==0.0.4 gym-notices==0.1.0 \
    tyro==1.0.17 docstring-parser==0.17.0 typeguard==4.4.4 cffi==1.17.1 pycparser==2.22
python3 -m pip wheel -q --no-deps -w .whl gym==0.26.2  # pure Python, published as a source archive only
du -sh .whl
