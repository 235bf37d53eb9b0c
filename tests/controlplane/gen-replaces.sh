#!/usr/bin/env bash
# Pins k8s.io/kubernetes and each of its staging modules in this module's go.mod.
# k8s.io/kubernetes is not meant to be a library: its go.mod requires k8s.io/api, client-go, ... at
# v0.0.0 and replaces them with ./staging/src/... directories that a module download does not have.
# The staging modules are published as k8s.io/NAME v0.MINOR.PATCH for kubernetes v1.MINOR.PATCH, so
# every "k8s.io/NAME => ./staging/..." line of the kubernetes go.mod becomes a replace to that version.
# Usage: tests/controlplane/gen-replaces.sh [v1.37.2]; then `go mod tidy` in tests/controlplane.
set -euo pipefail
cd "$(dirname "$0")"
version=${1:-$(go list -m -f '{{.Version}}' k8s.io/kubernetes 2>/dev/null || echo v1.37.2)}
staging=v0.${version#v1.}
gomod=$(go mod download -json "k8s.io/kubernetes@$version" | sed -n 's/^\s*"GoMod": "\(.*\)",\?$/\1/p')
[ -s "$gomod" ] || { echo "gen-replaces: no go.mod for k8s.io/kubernetes@$version" >&2; exit 1; }
modules=$(awk '$2 == "=>" && $3 ~ /^\.\/staging\// {print $1}' "$gomod")
[ -n "$modules" ] || { echo "gen-replaces: no staging replaces in $gomod" >&2; exit 1; }
args=(-require="k8s.io/kubernetes@$version")
for m in $modules; do
    args+=(-replace="$m=$m@$staging")
done
go mod edit "${args[@]}"
echo "gen-replaces: k8s.io/kubernetes $version, $(wc -w <<<"$modules") staging modules => $staging"
