#!/usr/bin/env bash
# Builds cotrain's base image, a minimal Debian 12 (bookworm) root filesystem, without Docker Hub:
# `debootstrap --variant=minbase bookworm` from the Debian mirror this machine's apt already uses
# (the first Debian URI of /etc/apt/sources.list.d/debian.sources, or of /etc/apt/sources.list),
# then `tar | docker import`. The image's apt gets this machine's Debian sources (debian.sources or
# the Debian lines of sources.list), so `apt-get install` in a Dockerfile built FROM it works wherever
# the mirror is reachable. Needs root (or password-less sudo) for debootstrap, which is installed with
# apt-get if missing. Idempotent: does nothing when the image exists (FORCE=1 rebuilds it).
# debootstrap writes about 200 MB in 25 s on a quiet 2-core machine (80-100 s while a cargo build
# shares the cores); the image is 116 MB.
#
#   deploy/docker/base-image.sh                       # -> cotrain-base:bookworm
#   COTRAIN_BASE_IMAGE=my/base:12 deploy/docker/base-image.sh
#   DEBIAN_MIRROR=http://ftp.de.debian.org/debian deploy/docker/base-image.sh
#   DOCKER=/usr/bin/docker ...                        # the docker client (default: the packaged one)
set -euo pipefail
IMAGE=${COTRAIN_BASE_IMAGE:-cotrain-base:bookworm}
SUITE=bookworm
if [ -z "${DOCKER:-}" ]; then
  # Prefer the client packaged with the daemon (Debian's docker.io) over any other on PATH.
  if [ -x /usr/bin/docker ]; then DOCKER=/usr/bin/docker; else DOCKER=docker; fi
fi
say() { echo "[base-image] $*" >&2; }
die() { echo "[base-image] error: $*" >&2; exit 1; }

if [ "${FORCE:-0}" != 1 ] && "$DOCKER" image inspect "$IMAGE" >/dev/null 2>&1; then
  say "$IMAGE exists (FORCE=1 rebuilds it)"
  exit 0
fi

SUDO=
[ "$(id -u)" = 0 ] || SUDO="sudo -n"

# --- the mirror -----------------------------------------------------------------------------------
# The first URI (deb822 "URIs:" or one-line "deb URI SUITE ...") that serves $SUITE itself (not
# bookworm-security, which is a different archive).
mirror_from_sources() {
  local f=/etc/apt/sources.list.d/debian.sources
  if [ -r "$f" ]; then
    awk -v suite="$SUITE" '
      /^[ \t]*#/ { next }
      /^[ \t]*$/ { if (uri != "" && has) { print uri; done = 1; exit } uri = ""; has = 0; next }
      tolower($1) == "uris:" { uri = $2 }
      tolower($1) == "suites:" { for (i = 2; i <= NF; i++) if ($i == suite) has = 1 }
      END { if (!done && uri != "" && has) print uri }' "$f"
  fi
  f=/etc/apt/sources.list
  if [ -r "$f" ]; then
    awk -v suite="$SUITE" '$1 == "deb" { i = 2; if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                                         if ($(i + 1) == suite) { print $i; exit } }' "$f"
  fi
}
MIRROR=${DEBIAN_MIRROR:-$(mirror_from_sources | head -n1)}
[ -n "$MIRROR" ] || MIRROR=http://deb.debian.org/debian
say "mirror: $MIRROR"

# --- debootstrap ------------------------------------------------------------------------------------
if ! command -v debootstrap >/dev/null; then
  command -v apt-get >/dev/null || die "debootstrap is not installed and there is no apt-get to install it"
  say "installing debootstrap with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  if ! $SUDO apt-get install -y -qq --no-install-recommends debootstrap >/dev/null 2>&1; then
    $SUDO apt-get update -qq >/dev/null 2>&1 || true
    $SUDO apt-get install -y -qq --no-install-recommends debootstrap >/dev/null || die "apt-get could not install debootstrap"
  fi
fi

ROOTFS=$(mktemp -d /var/tmp/cotrain-rootfs.XXXXXX)
cleanup() { $SUDO rm -rf "$ROOTFS"; }
trap cleanup EXIT
t0=$(date +%s)
say "debootstrap --variant=minbase $SUITE into $ROOTFS"
if ! $SUDO debootstrap --variant=minbase "$SUITE" "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1; then
  tail -n 20 "$ROOTFS.log" >&2
  die "debootstrap failed (log: $ROOTFS.log)"
fi
rm -f "$ROOTFS.log"

# apt inside the image: this machine's Debian sources (with bookworm-updates and -security where it
# has them), else the one line debootstrap wrote.
if [ -z "${DEBIAN_MIRROR:-}" ] && [ -r /etc/apt/sources.list.d/debian.sources ]; then
  $SUDO cp /etc/apt/sources.list.d/debian.sources "$ROOTFS/etc/apt/sources.list.d/debian.sources"
  $SUDO rm -f "$ROOTFS/etc/apt/sources.list"
elif [ -z "${DEBIAN_MIRROR:-}" ] && grep -q "^deb .*debian" /etc/apt/sources.list 2>/dev/null; then
  grep "^deb .*debian" /etc/apt/sources.list | $SUDO tee "$ROOTFS/etc/apt/sources.list" >/dev/null
fi
# As Docker's Debian images do: no cached packages or lists, no services started by package scripts.
$SUDO rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/log/*.log
printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$ROOTFS/usr/sbin/policy-rc.d" >/dev/null
$SUDO chmod 755 "$ROOTFS/usr/sbin/policy-rc.d"
printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' \
  | $SUDO tee "$ROOTFS/etc/apt/apt.conf.d/90cotrain-no-recommends" >/dev/null

say "docker import -> $IMAGE"
$SUDO tar -C "$ROOTFS" --numeric-owner -c . | "$DOCKER" import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  --message "debootstrap --variant=minbase $SUITE $MIRROR" - "$IMAGE" >/dev/null
say "$IMAGE built in $(( $(date +%s) - t0 ))s ($("$DOCKER" image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%d MB", $1 / 1e6}'))"
