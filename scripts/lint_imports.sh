#!/usr/bin/env bash
# The layering check in `make lint`: import-linter's contracts (pyproject.toml,
# [tool.importlinter]; docs/architecture.md, "Layers") over every import, inside functions too.
# components/, pipelines/ and kernels/ install as moerl.components, moerl.pipelines and
# moerl.kernels (pyproject.toml package-dir), which is how the code imports them; import-linter
# finds a package's modules under its folder, so it reads a view of the tree laid out as
# installed: symlinks to the real files, made afresh in a temporary folder each run.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
lint_imports="${LINT_IMPORTS:-$root/.venv/bin/lint-imports}"
view="$(mktemp -d)"
trap 'rm -rf "$view"' EXIT
cp -rs "$root/moerl" "$view/moerl"
for pkg in components pipelines kernels; do
  cp -rs "$root/$pkg" "$view/moerl/$pkg"
done
cp -rs "$root/benchmarks" "$view/benchmarks"
cd "$view"  # lint-imports puts the working directory first on sys.path: the view, not the tree
"$lint_imports" --no-cache "$root/pyproject.toml"
