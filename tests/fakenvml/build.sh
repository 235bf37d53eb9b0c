#!/usr/bin/env bash
# Builds the fake libnvidia-ml.so.1 into tests/fakenvml/build/ (needs gcc).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$here/build"
gcc -std=c11 -O2 -g -Wall -Wextra -Werror -fPIC -shared -pthread \
    -Wl,-soname,libnvidia-ml.so.1 -o "$here/build/libnvidia-ml.so.1" "$here/fakenvml.c"
