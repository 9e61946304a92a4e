#!/usr/bin/env bash
# The deployment checks, as `make test` runs them: the Kubernetes manifests (deploy/k8s/validate.sh),
# the container image built and trained through a cluster of its containers (deploy/docker/test-local.sh),
# and the Slurm job on a private local Slurm cluster (deploy/slurm/test-local.sh; after the Docker test,
# so that it runs with Docker's docker0 bridge present). Each installs what it needs (Debian's docker.io
# and debootstrap, Debian's Slurm, a venv with kubernetes-validate, Debian's kubectl unpacked under
# the cache) and says SKIP only where that cannot be had; COTRAIN_ALLOW_SKIP=0 makes that a failure.
#
#   deploy/test.sh                              # binaries from target/release
#   COTRAIN_BIN=target/debug deploy/test.sh     # as `make test` runs it
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
export COTRAIN_ALLOW_SKIP=${COTRAIN_ALLOW_SKIP:-1}
passed=0 failed=0 skipped=0
for t in deploy/k8s/validate.sh deploy/docker/test-local.sh deploy/slurm/test-local.sh; do
  echo "== $t"
  start=$(date +%s)
  out=$(mktemp)
  bash "$t" 2>&1 | tee "$out"
  rc=${PIPESTATUS[0]}
  if [ "$rc" != 0 ]; then
    failed=$((failed + 1))
  elif grep -q '^SKIP: ' "$out"; then
    skipped=$((skipped + 1))
  else
    passed=$((passed + 1))
  fi
  rm -f "$out"
  echo "== $t: exit $rc in $(( $(date +%s) - start ))s"
done
echo "deploy: $passed passed, $failed failed, $skipped skipped"
[ "$failed" = 0 ]
